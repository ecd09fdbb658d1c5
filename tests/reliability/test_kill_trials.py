"""SIGKILL real training processes at random points, during capture writes and during on-disk
ring writes: every capture on disk opens and is complete, every flushed step of the stream is
readable, the daemon still raises its alert, and rings of killed runs become crash captures."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until

from .checks import check_capture, check_stream, first_nonfinite

TRIALS = 24  # 8 at a random moment, 8 while a capture is being written, 8 with the on-disk ring


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(pred, pid: int, timeout_s: float) -> bool:
    """Poll ``pred`` every ~2 ms until true (True) or the trial process ended (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        if pred():
            return True
        time.sleep(0.002)
    return False


@pytest.mark.slow
def test_sigkill_at_random_points(zygote, make_daemon, tmp_path):
    daemon = make_daemon(extra=["--no-replay"])
    rng = random.Random(5)
    trials = []
    t0 = time.monotonic()
    for i in range(TRIALS):
        mode = ("random", "capture", "ring")[i % 3]
        run_id = f"kill-{i:02d}-{mode}"
        run_dir = daemon.runs_dir / run_id
        nan_at = rng.randrange(8, 30)
        agent = {"snapshot_every": 10, "window": 40, "flush_s": 0.05, "post_steps": 2,
                 "disk_ring": mode == "ring" or i % 4 == 0}
        pid = zygote.train(run_id=run_id, runs_dir=str(daemon.runs_dir), steps=60, nan_at=nan_at,
                           sleep_s=0.004, hidden=512, agent=agent, log=str(tmp_path / f"{run_id}.log"))
        if mode == "capture":  # the moment the capture's temp file exists
            hit = _wait_for(lambda: any(run_dir.glob("capture-*.h5.tmp")), pid, 30)
        elif mode == "ring":  # while the on-disk ring is written: its steps are appended to the open
            # segment (no temp file: tests/contracts/test_ringrecord.py cuts a record short at every
            # byte), so kill soon after the first segment exists, during a snapshot's write (its temp
            # file) when one comes within 0.1 s; no snapshot is taken while an incident is open, so
            # waiting for one let most runs end unkilled (6 of 8 here)
            _wait_for(lambda: any(run_dir.glob("ring-*/steps-*.ring")), pid, 30)
            time.sleep(rng.uniform(0.0, 0.1))
            hit = _wait_for(lambda: any(run_dir.glob("ring-*/*.tmp")), pid, 0.1)
        else:
            _wait_for(lambda: (run_dir / "run.json").exists(), pid, 30)
            time.sleep(rng.uniform(0.0, 0.5))
            hit = True
        try:
            signal_sent = zygote_kill(pid)
        finally:
            status = zygote.reap(pid)
        trials.append((run_id, mode, hit, signal_sent, status, nan_at))

    print(f"\ntrials took {time.monotonic() - t0:.1f} s")
    killed = [t for t in trials if t[4] == -signal.SIGKILL]
    during_capture = [t for t in trials if t[1] == "capture" and t[2] and t[4] == -signal.SIGKILL]
    print(f"\n{len(trials)} trials, {len(killed)} SIGKILLed before finishing, "
          f"{len(during_capture)} during a capture write, "
          f"{sum(1 for t in trials if t[1] == 'ring' and t[2])} during an on-disk ring write")
    assert len(killed) >= 20 and len(during_capture) >= 6

    expected_alerts = set()
    complete = 0
    for run_id, mode, _hit, _sent, status, nan_at in trials:
        run_dir = daemon.runs_dir / run_id
        stream = run_dir / "stream-rank0.jsonl"
        steps = check_stream(stream) if stream.exists() else []
        bad = first_nonfinite(steps)
        if bad is not None:
            assert bad == nan_at
            expected_alerts.add(run_id)
        for cap in run_dir.glob("capture-*.h5"):
            check_capture(cap)
            complete += 1

    # The daemon raises the alert of every run whose NaN step reached the stream, once each.
    def alerted() -> set[str]:
        return {n["run"] for n in daemon.notifications() if n["kind"] == "alert" and n["signature"] == "nonfinite"}

    wait_until(lambda: alerted() >= expected_alerts, 60, f"alerts for {sorted(expected_alerts)}")
    alerts = [n for n in daemon.notifications() if n["kind"] == "alert" and n["signature"] == "nonfinite"]
    assert len(alerts) == len({n["run"] for n in alerts}), "an incident was alerted twice"

    # Rings of killed processes become crash captures (the daemon assembles them), then go away.
    wait_until(lambda: not any(daemon.runs_dir.glob("*/ring-*")), 60, "every dead ring recovered")
    crash_caps = list(daemon.runs_dir.glob("*/capture-*-crash.h5"))
    for cap in crash_caps:
        assert "on-disk ring" in check_capture(cap)["message"]
    ring_killed = sum(1 for t in trials if t[1] == "ring" and t[4] == -signal.SIGKILL)
    assert len(crash_caps) >= ring_killed // 2, f"{len(crash_caps)} crash captures from {ring_killed} killed ring runs"
    # status.json is rewritten on the daemon's next tick after a recovery: wait for it, then exact
    wait_until(lambda: daemon.status()["rings_recovered"] >= len(crash_caps), 10, "status counts the recoveries")
    assert daemon.status()["rings_recovered"] == len(crash_caps)
    print(f"captures opened and complete: {complete + len(crash_caps)} ({len(crash_caps)} assembled from "
          f"on-disk rings), alerts: {len(alerts)} for {len(expected_alerts)} incidents (lost 0, duplicates 0)")


def zygote_kill(pid: int) -> bool:
    import os

    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
