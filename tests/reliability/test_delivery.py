"""Delivery: every notification is in the outbox before it is sent, retried while a destination
fails, sent once per incident, and neither lost nor sent twice when the daemon is SIGKILLed
mid-delivery (the one window left, inside the send itself, gives a marked copy with the same id)."""

from __future__ import annotations

import json
import random
import time

import pytest

from sentineld.daemon.outbox import Notification, Outbox
from tests.conftest import wait_until

from .checks import write_run

FAST_RETRY = {"retry_initial_s": 0.3, "retry_max_s": 1.0}


def _outbox(daemon) -> Outbox:
    return Outbox(daemon.state_dir / "outbox")


def _alert_ids(daemon) -> list[str]:
    return [n["id"] for n in daemon.notifications() if n["kind"] == "alert"]


# The runs below stay non-finite to their end (a divergence): one alert each, no recovery notice
# (20 finite steps after a NaN end its incident: test_rate_limit_spares_a_new_nonfinite_incident...).


def test_smtp_down_then_up_alert_arrives_once(smtp, make_daemon):
    daemon = make_daemon(notify=[smtp.url], extra=["--no-replay"], config=FAST_RETRY)
    write_run(daemon.runs_dir, "down", 40, set(range(12, 40)))
    # The alert is in the outbox (and the log) while the mail server is down, and retried.
    wait_until(lambda: _alert_ids(daemon), 30, "the alert in the notifications log")
    wait_until(lambda: daemon.status().get("delivery_failures", 0) >= 3, 30, "three failed attempts")
    [note] = list(_outbox(daemon))
    assert note.targets["log"] == "delivered" and note.attempts >= 3 and note.last_error
    assert smtp.inbox.messages == []
    smtp.start()
    wait_until(lambda: smtp.inbox.messages, 30, "the alert email after the server came back")
    time.sleep(0.8)
    assert smtp.inbox.ids() == [note.id] and smtp.inbox.resends() == []
    assert "nonfinite" in smtp.inbox.bodies()[0] and f"notification id: {note.id}" in smtp.inbox.bodies()[0]
    assert list(_outbox(daemon)) == [] and [n.id for n in _outbox(daemon).delivered()] == [note.id]
    assert _alert_ids(daemon) == [note.id]


def test_sigkill_during_send_before_the_server_took_it(smtp, make_daemon):
    """Killed while the SMTP dialogue stalls before DATA: the restarted daemon finds the
    ``sending`` mark, sends again, and the one message that exists is marked as a possible repeat."""
    smtp.start()
    smtp.inbox.rcpt_delay_s = 30
    daemon = make_daemon(notify=[smtp.url], extra=["--no-replay"], config=FAST_RETRY)
    write_run(daemon.runs_dir, "mid-send", 30, set(range(7, 30)))
    assert smtp.inbox.in_rcpt.wait(30), "the daemon never reached the SMTP server"
    daemon.kill()
    [note] = list(_outbox(daemon))
    assert "sending" in note.targets.values()  # fsynced before the send began
    smtp.inbox.rcpt_delay_s = 0
    daemon.start()
    wait_until(lambda: smtp.inbox.messages, 30, "the email after the restart")
    wait_until(lambda: not list(_outbox(daemon)), 10, "the outbox to empty")
    time.sleep(0.6)
    assert smtp.inbox.ids() == [note.id]  # not lost, not doubled
    [done] = list(_outbox(daemon).delivered())
    assert sum(done.resent.values()) == 1 and _alert_ids(daemon) == [note.id]


def test_sigkill_inside_the_send_gives_one_marked_copy_with_the_same_id(smtp, make_daemon):
    """The remaining window: the server took the message, the daemon dies before it hears 250.
    After the restart the destination gets a second copy marked as a resend, with the same
    X-Sentineld-Id, so a receiver can drop it; the notifications log still has it once."""
    smtp.start()
    smtp.inbox.after_data_delay_s = 30
    daemon = make_daemon(notify=[smtp.url], extra=["--no-replay"], config=FAST_RETRY)
    write_run(daemon.runs_dir, "in-doubt", 30, set(range(7, 30)))
    assert smtp.inbox.in_data.wait(30), "the message never reached the SMTP server"
    daemon.kill()
    smtp.inbox.after_data_delay_s = 0
    daemon.start()
    wait_until(lambda: len(smtp.inbox.messages) >= 2, 30, "the resent copy")
    time.sleep(0.6)
    ids = smtp.inbox.ids()
    assert len(ids) == 2 and len(set(ids)) == 1 and smtp.inbox.resends() == ids[1:]
    assert "sent again" in smtp.inbox.bodies()[1]
    assert _alert_ids(daemon) == ids[:1]


def test_log_destination_in_doubt_is_checked_not_repeated(make_daemon, tmp_path):
    """A daemon that died between appending to the notifications log and recording it: the log
    is searched for the id, so it is appended exactly once either way."""
    daemon = make_daemon(extra=["--no-replay"], start=False)
    box = Outbox(daemon.state_dir / "outbox")
    logged = Notification(id="already-logged-1", kind="alert", title="t", body="b", targets={"log": "sending"})
    missing = Notification(id="not-logged-2", kind="alert", title="t", body="b", targets={"log": "sending"})
    box.add(logged)
    box.add(missing)
    (daemon.state_dir / "notifications.jsonl").write_text(json.dumps({"id": logged.id, "kind": "alert"}) + "\n")
    daemon.start()
    wait_until(lambda: not list(box), 20, "both settled")
    assert [n["id"] for n in daemon.notifications()] == [logged.id, missing.id]


def test_failing_destination_is_retried_and_the_others_not_resent(smtp, sink, make_daemon):
    smtp.start()
    sink.status = 500
    daemon = make_daemon(notify=[smtp.url, sink.url], extra=["--no-replay"], config=FAST_RETRY)
    write_run(daemon.runs_dir, "partial", 30, set(range(9, 30)))
    wait_until(lambda: len(sink.posts) >= 2, 30, "retries to the failing webhook")
    assert len(smtp.inbox.messages) == 1
    daemon.kill()  # mid-retry
    daemon.notify.reverse()  # and the URL list reordered: destinations are keyed by URL, not position
    daemon.start()
    wait_until(lambda: len(sink.posts) >= 4, 30, "retries after the restart")
    sink.status = 200
    wait_until(lambda: sink.ids(), 30, "the webhook to take it")
    time.sleep(0.6)
    [note] = list(_outbox(daemon).delivered())
    assert smtp.inbox.ids() == [note.id] and sink.ids() == [note.id]
    assert note.attempts >= 3


@pytest.mark.slow
def test_random_daemon_kills_during_a_burst_lose_nothing(smtp, sink, make_daemon):
    smtp.start()
    smtp.inbox.rcpt_delay_s = 0.15  # each email takes a while: kills land mid-send
    daemon = make_daemon(notify=[smtp.url, sink.url], extra=["--no-replay"], config=FAST_RETRY)
    n_runs = 12
    for i in range(n_runs):
        write_run(daemon.runs_dir, f"burst-{i:02d}", 30, set(range(5 + i, 30)))
    rng = random.Random(3)
    kills = 0
    for _ in range(6):
        time.sleep(rng.uniform(0.3, 1.2))
        daemon.kill()
        kills += 1
        daemon.start()
    wait_until(lambda: len(set(smtp.inbox.ids())) == n_runs and len(set(sink.ids())) == n_runs, 90,
               "every alert at both destinations")
    wait_until(lambda: not list(_outbox(daemon)), 20, "the outbox to empty")
    time.sleep(0.6)
    done = {n.id: n for n in _outbox(daemon).delivered()}
    assert len(done) == n_runs and sorted(set(smtp.inbox.ids())) == sorted(done)
    log_ids = _alert_ids(daemon)
    assert sorted(log_ids) == sorted(done)  # the log: exactly once each
    mail_dups = len(smtp.inbox.ids()) - n_runs
    hook_dups = len(sink.ids()) - n_runs
    resent = sum(sum(n.resent.values()) for n in done.values())
    # Nothing is sent twice unmarked: a repeat only comes from a send the daemon died inside,
    # and it says so (X-Sentineld-Resend) with the same id, so the receiver can drop it.
    for unmarked in (smtp.inbox.unmarked(), sink.ids(resends=False)):
        assert len(unmarked) == len(set(unmarked)), "an unmarked duplicate"
    assert mail_dups + hook_dups <= resent
    print(f"\n{n_runs} alerts x 2 destinations through {kills} daemon SIGKILLs: lost 0, unmarked "
          f"duplicates 0, marked repeats {mail_dups + hook_dups} (in-doubt resends {resent})")


def test_rate_limit_spares_a_new_nonfinite_incident_and_recovery_notices(make_daemon):
    daemon = make_daemon(extra=["--no-replay"], config={"alert_interval_s": 3600.0})
    # NaN at step 5 (alert), 20 finite steps later it is over (recovery notice), NaN again at 300:
    # a new incident, alerted within alert_interval_s (issue 10: a run that recovered and broke
    # again got no second alert), and over again 20 steps later. alert_interval_s still limits
    # the signatures that flap (tests/daemon/test_policy.py).
    write_run(daemon.runs_dir, "flap", 700, {5, 300})
    wait_until(lambda: len(daemon.notifications()) == 4 and
               [r["last_step"] for r in daemon.status().get("runs", [])] == [699], 30,
               "the whole stream evaluated")
    time.sleep(0.6)
    kinds = [(n["kind"], n["signature"], n["step"]) for n in daemon.notifications()]
    assert kinds[0] == ("alert", "nonfinite", 5)
    assert kinds[1][:2] == ("recovery", "nonfinite")
    assert kinds[2] == ("alert", "nonfinite", 300)
    assert kinds[3][:2] == ("recovery", "nonfinite")
    assert len(kinds) == 4 and daemon.status().get("alerts_suppressed") == 0
    assert "RESOLVED nonfinite" in daemon.notifications()[1]["title"]
