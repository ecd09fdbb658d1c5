"""A restarted daemon leaves the incident's page as it was (issue 16): real training processes,
the real daemon killed with SIGKILL and started again on the same state dir, the real
Alertmanager with the shipped routes and templates delivering Slack to an HTTP sink.

Run ``rr``: one rank, NaN in every batch (the loop skips those optimizer steps) until the test
heals it; it has a recipe, so its incident gets the replay's verdict (``SentineldReplay``). Run
``cr``: its loop raises (``SentineldCrashed``). After the restart every alert is re-posted with
the same labels and start, none resolves while ``rr`` is non-finite, and once ``rr`` recovers its
whole incident, verdict included, resolves in one notification (before, the restarted daemon
no longer knew the verdict and crash alerts: they were never re-sent, and the verdict stayed
firing after the incident ended).
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import pytest

from .helpers import Server, free_port, http_json, wait_for
from .test_alertmanager_config import Mailbox
from .test_oncall import TimedSink, _am_config, _train


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _active(am: Server) -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
    """Alertmanager's active alerts by label set."""
    alerts = http_json(f"{am.url}/api/v2/alerts?active=true&silenced=false&inhibited=false")
    return {tuple(sorted(a["labels"].items())): a for a in alerts if a["status"]["state"] == "active"}


def _posts(slack: TimedSink, run: str) -> list[dict[str, Any]]:
    slack.stamp()
    return [{"t": r["t"], "title": a["title"], "text": a["text"]} for r in list(slack.received)
            for a in r["json"]["attachments"] if a["title"].endswith(f" run {run}")]


@pytest.mark.slow
def test_restart_keeps_verdict_and_crash_alerts_and_resolves_them_with_the_incident(
        tmp_path: Path, start_alertmanager: Callable[[Path], Server]) -> None:
    pytest.importorskip("aiosmtpd")
    from tests.conftest import DaemonProc

    slack, mailbox = TimedSink(), Mailbox()
    daemons: list[Any] = []
    procs: list[Any] = []
    try:
        am = start_alertmanager(_am_config(tmp_path, slack.url + "/slack", mailbox.port))
        runs = tmp_path / "runs"
        runs.mkdir()
        config = tmp_path / "sentineld.toml"
        config.write_text("window = 50\n")  # rr's incident is over 50 clean steps after it heals
        args = ["--alertmanager-url", am.url, "--config", str(config)]
        first = DaemonProc(runs, tmp_path / "state", [], args).start()
        daemons.append(first)
        procs += [_train(runs, "rr", 0, 1, free_port(), 3.0, "heal", "yes", tmp_path / "rr.log",
                        duration_s=240.0, sleep_s=0.05),
                 _train(runs, "cr", 0, 1, free_port(), 3.0, "raise", "no", tmp_path / "cr.log")]
        names = {"rr": {"SentineldNonfinite", "SentineldReplay"}, "cr": {"SentineldCrashed"}}

        def incident_alerts() -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
            got = {k: a for k, a in _active(am).items() if a["labels"].get("run") in names}
            have = {r: {a["labels"]["alertname"] for a in got.values() if a["labels"]["run"] == r} for r in names}
            return got if have == names else {}

        before = wait_for(incident_alerts, 180, "rr's incident with its verdict and cr's crash in Alertmanager",
                          step_s=0.5)
        wait_for(lambda: [p for p in _posts(slack, "rr") if "SentineldReplay" in p["title"]], 60, "rr's page")
        assert procs[1].wait(timeout=60) != 0  # cr's loop raised

        first.stop(signal.SIGKILL)  # no chance to save anything more
        restarted_s = time.time()
        daemons.append(DaemonProc(runs, tmp_path / "state", [], args).start())
        again = wait_for(lambda: (lambda now: now if now.keys() == before.keys() and all(
            _ts(a["updatedAt"]) >= restarted_s for a in now.values()) else {})(incident_alerts()),
            60, "the restarted daemon to re-post every alert of both incidents", step_s=0.5)
        for key, alert in again.items():
            assert alert["startsAt"] == before[key]["startsAt"], key
            assert alert["annotations"] == before[key]["annotations"], key
            assert _ts(alert["endsAt"]) - time.time() > 12 * 3600  # held, not about to resolve
        time.sleep(7)  # more than group_interval (5 s): a change would have been notified
        healed_s = time.time()
        assert not [p for p in _posts(slack, "rr") + _posts(slack, "cr") if "RESOLVED" in p["title"]]

        (runs / "heal-rr").touch()
        resolved = wait_for(lambda: [p for p in _posts(slack, "rr") if p["title"].startswith("[RESOLVED]")],
                            90, "rr's incident to resolve once its run recovered", step_s=0.5)
        # The whole incident, its verdict too, resolves in one notification; cr's crash stays.
        assert resolved[0]["title"] == "[RESOLVED] SentineldNonfinite, SentineldReplay run rr", resolved
        assert resolved[0]["t"] > healed_s
        assert not [p for p in _posts(slack, "rr") if p["t"] > resolved[0]["t"] and "FIRING" in p["title"]]
        assert {a["labels"]["alertname"] for a in _active(am).values() if a["labels"].get("run") in names} \
            == {"SentineldCrashed"}
        assert not [p for p in _posts(slack, "cr") if "RESOLVED" in p["title"]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for d in daemons:
            d.stop()
        slack.close()
        mailbox.close()
