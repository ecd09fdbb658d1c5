"""State files a real user can damage (breaker pass): am_extras.json with wrong-typed alerts."""

from __future__ import annotations

import json

from sentineld.daemon.alertmanager import DAEMON_HOLD_S
from sentineld.daemon.am_active import ActiveAlerts
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import Outbox


def test_wrong_typed_saved_alerts_are_skipped_and_the_good_one_restored(tmp_path, caplog):
    # A list label value raised TypeError (unhashable) out of restore_extras at daemon start;
    # an int label, list annotations or a numeric startsAt were re-sent, and Alertmanager
    # answers 400 to the whole post: every live alert sent with them was held back for good.
    clock = lambda: 1_790_000_000.0  # noqa: E731
    n = Notifier(Outbox(tmp_path / "outbox"), [], clock, ActiveAlerts(resend_s=60.0, hold_s=DAEMON_HOLD_S, clock=clock),
                 extras_path=tmp_path / "am_extras.json", host="node-a")
    good = {"labels": {"alertname": "SentineldReplay", "signature": "replay", "run": "r1"},
            "annotations": {"summary": "replay of run r1"}, "startsAt": "2026-09-21T14:13:20.000Z"}
    (tmp_path / "am_extras.json").write_text(json.dumps([
        {"labels": {"alertname": "SentineldReplay", "signature": "replay", "run": ["r1"]}},
        {"labels": {"alertname": "SentineldReplay", "signature": "replay", "step": 3}},
        {"labels": {"alertname": "SentineldCrashed", "signature": "crashed"}, "annotations": ["x"]},
        {"labels": {"alertname": "SentineldCrashed", "signature": "crashed"}, "startsAt": 12},
        good]))
    assert n.restore_extras() == 1
    due = n.am.due()
    assert [(a["labels"], a["annotations"], a["startsAt"]) for a in due] == [
        (good["labels"], good["annotations"], good["startsAt"])]
    assert caplog.text.count("not restored") == 4


def _status_cli(state_dir):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sentineld", "status", "--state-dir", str(state_dir)],
                          capture_output=True, text=True, timeout=60)


def test_status_json_of_the_wrong_type_is_no_status_not_a_traceback(tmp_path):
    # status.json holding a JSON list: AttributeError: 'list' object has no attribute 'get'.
    (tmp_path / "status.json").write_text("[1, 2]")
    r = _status_cli(tmp_path)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() == f"sentineld daemon: not running (state dir {tmp_path})"


def test_status_of_a_running_daemon_with_an_older_status_json_shows_what_it_has(tmp_path):
    # A status.json lacking keys (another daemon version) raised KeyError: 'runs_watched'.
    from filelock import FileLock

    (tmp_path / "status.json").write_text(json.dumps({"runs_dir": "/data/runs", "runs": [{"run_id": "r1"}, 7]}))
    (tmp_path / "daemon.pid").write_text("4242")
    with FileLock(str(tmp_path / "daemon.lock")):  # held as a running daemon holds it
        r = _status_cli(tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "running (pid 4242), runs dir /data/runs" in r.stdout
    assert "runs watched: ?" in r.stdout and "notify: log only" in r.stdout and "r1" in r.stdout
