"""A run that recovers and breaks again, watched by the real agent and a real daemon delivering to a
real HTTP endpoint (issue 10, detection gap 2).

GradScaler skips the step whose batch holds a nan (loss nan, parameters untouched), 50 finite
steps follow, then a second bad batch. On main before this fix the agent re-armed only after 100
finite steps and the daemon's ``nonfinite`` kept firing while the nan was anywhere in its 200-record
window: one alert, one capture, no recovery notice ever, and ``nonfinite`` active in ``status``
after the run had finished. Now: alert, recovery notice, second alert, a capture per incident, and
the finished run's signatures closed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sentineld.contracts.nonfinite import REARM_STEPS
from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO, wait_until

BAD = (10, 61)

TRAIN = f"""
import sys, time, torch, torch.nn.functional as F
from sentineld.agent import attach
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(m.parameters(), 0.1)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
with attach(m, opt, run_id="twice", runs_dir=sys.argv[1], metrics_port=0, scaler=scaler,
            localize="off", capture_on_sigterm=False) as watch:
    for i in range(75):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        if i in {BAD!r}:
            x[0, 0] = float("nan")  # a bad batch: GradScaler skips this step
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        watch.step(loss, batch=(x, y))
        time.sleep(0.03)  # a step a daemon can follow live
    assert all(torch.isfinite(p).all() for p in m.parameters())  # both bad steps were skipped
"""


@pytest.mark.slow
def test_recovered_run_gets_recovery_notice_second_alert_and_closes(daemon_factory, http_sink):
    port, sink = http_sink
    daemon = daemon_factory(notify=[f"json://127.0.0.1:{port}/hook"], extra=["--no-replay"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", TRAIN, str(daemon.runs_dir)], cwd=REPO, check=True,
                   timeout=120, env=env)
    run_dir = daemon.runs_dir / "twice"
    assert [(c[1], c[2]) for c in list_captures(run_dir)] == [(BAD[0], "nonfinite"), (BAD[1], "nonfinite")]

    def delivered():
        with sink.lock:
            return [obj.get("title", "") for _, _, obj in sink.posts if isinstance(obj, dict)]

    wait_until(lambda: sum("nonfinite" in t for t in delivered()) >= 3, 60, "alert, recovery, alert")
    notes = [(n["kind"], n["signature"], n["step"]) for n in daemon.notifications() if n["run"] == "twice"]
    assert notes[0] == ("alert", "nonfinite", BAD[0])
    assert notes[1] == ("recovery", "nonfinite", BAD[0] + REARM_STEPS)  # the 20th finite step after it
    assert notes[2] == ("alert", "nonfinite", BAD[1])
    titles = delivered()
    assert any(t.startswith("[sentineld] RESOLVED nonfinite in run twice") for t in titles)
    assert sum("CRITICAL nonfinite in run twice" in t for t in titles) == 2

    def run_status():
        return next((r for r in daemon.status().get("runs", []) if r["run_id"] == "twice"), None)

    st = wait_until(lambda: (lambda r: r if r and r["ended"] and not r["active"] else None)(run_status()),
                    30, "the finished run's signatures closed")
    assert st["ended"] == {"0": "finished"}
    time.sleep(1.5)  # closing is no recovery: nothing more is sent for the finished run
    assert [n["kind"] for n in daemon.notifications() if n["run"] == "twice"] == ["alert", "recovery", "alert"]


@pytest.mark.slow
def test_daemon_started_after_the_run_reports_both_incidents(daemon_factory, tmp_path):
    """Read in one go (the daemon was down while the run trained): before this fix one slice of
    100 records held both incidents and only the second was alerted."""
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", TRAIN.replace("time.sleep(0.03)", "pass"), str(runs)], cwd=REPO,
                   check=True, timeout=120, env=env)
    daemon = daemon_factory(extra=["--no-replay"], runs_dir=runs)

    def notes():
        return [(n["kind"], n["step"]) for n in daemon.notifications()
                if n["run"] == "twice" and n["signature"] == "nonfinite"]

    wait_until(lambda: len(notes()) >= 3, 60, "alert, recovery, alert")
    got = notes()
    assert got == [("alert", BAD[0]), ("recovery", BAD[0] + REARM_STEPS), ("alert", BAD[1])]
    wait_until(lambda: any(r["run_id"] == "twice" and not r["active"] for r in daemon.status().get("runs", [])),
               30, "the finished run's signatures closed")
