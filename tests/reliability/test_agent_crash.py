"""A training process that dies writes its ring buffer as a ``crash`` capture first: by an uncaught
exception without ``with`` (sys.excepthook), by SIGTERM (preemption; the signal keeps its effect),
at interpreter exit without ``close()``; and with the on-disk ring, even after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, wait_until

from .checks import check_capture, check_stream
from .conftest import run_once


def _captures(run_dir: Path, trigger: str = "") -> list[Path]:
    return sorted(run_dir.glob(f"capture-*{trigger}.h5"))


def _end_reason(run_dir: Path) -> str | None:
    lines = [json.loads(x) for x in (run_dir / "stream-rank0.jsonl").read_text().splitlines()]
    ends = [o for o in lines if o.get("kind") == "end"]
    return ends[-1]["reason"] if ends else None


def test_sigterm_writes_crash_capture_and_keeps_the_signals_effect(zygote, tmp_path):
    runs = tmp_path / "runs"
    base = dict(runs_dir=str(runs), steps=100_000, sleep_s=0.005, marker_step=25,
                agent={"snapshot_every": 10, "flush_s": 0.05}, log=str(tmp_path / "train.log"))
    specs = {
        "default": dict(base, run_id="term-default", marker=str(tmp_path / "m-default")),
        "chained": dict(base, run_id="term-chained", marker=str(tmp_path / "m-chained"),
                        user_sigterm_marker=str(tmp_path / "user-handler-ran")),
        "ignored": dict(base, run_id="term-ignored", marker=str(tmp_path / "m-ignored"), steps=60,
                        ignore_sigterm=True),
    }
    pids = {k: zygote.train(**s) for k, s in specs.items()}
    for k, pid in pids.items():
        wait_until(lambda: Path(specs[k]["marker"]).exists(), 60, f"{k} at step 25")
        os.kill(pid, signal.SIGTERM)
    status = {k: zygote.reap(pid) for k, pid in pids.items()}
    log = (tmp_path / "train.log").read_text() if (tmp_path / "train.log").exists() else ""

    # Default action kept: the process still dies by SIGTERM, after writing the capture.
    assert status["default"] == -signal.SIGTERM, log[-2000:]
    [cap] = _captures(runs / "term-default", "crash")
    info = check_capture(cap)
    assert "SIGTERM" in info["message"] and info["first_step"] >= 25
    assert _end_reason(runs / "term-default") == "terminated"
    check_stream(runs / "term-default" / "stream-rank0.jsonl")

    # A handler the loop installed before attach still runs (here it exits with 143).
    assert status["chained"] == 143, log[-2000:]
    assert (tmp_path / "user-handler-ran").exists()
    check_capture(_captures(runs / "term-chained", "crash")[0])

    # SIGTERM ignored before attach stays ignored: the run finishes, no crash capture.
    assert status["ignored"] == 0, log[-2000:]
    assert _captures(runs / "term-ignored") == []
    assert _end_reason(runs / "term-ignored") == "finished"


def test_a_second_sigterm_during_the_crash_capture_does_not_lose_it(zygote, tmp_path):
    """d9bb298: a scheduler and torchrun both signal the group; a second SIGTERM 45-258 ms after
    the first killed 6/6 runs mid-capture (no capture, partial .h5.tmp files left)."""
    runs = tmp_path / "runs"
    pids = {}
    for gap_s in (0.05, 0.2):
        rid = f"twice-{int(gap_s * 1000)}"
        pids[rid] = (gap_s, zygote.train(run_id=rid, runs_dir=str(runs), steps=100_000, hidden=1536,
                                         marker=str(tmp_path / rid), marker_step=12,
                                         log=str(tmp_path / f"{rid}.log"), agent={"snapshot_every": 5, "flush_s": 0.05}))
    for rid, (gap_s, pid) in pids.items():
        wait_until(lambda: (tmp_path / rid).exists(), 120, f"{rid} at step 12")
        os.kill(pid, signal.SIGTERM)
        time.sleep(gap_s)
        os.kill(pid, signal.SIGTERM)
        assert zygote.reap(pid) == -signal.SIGTERM, rid  # still dies as signalled
        caps = _captures(runs / rid, "crash")
        assert len(caps) == 1, (sorted(p.name for p in (runs / rid).iterdir()), (tmp_path / f"{rid}.log").read_text())
        assert "SIGTERM" in check_capture(caps[0])["message"]
        assert list((runs / rid).glob("*.tmp")) == [], rid


def test_uncaught_exception_without_with_and_exit_without_close(tmp_path):
    runs = tmp_path / "runs"
    crash = run_once(dict(run_id="exc", runs_dir=str(runs), steps=40, raise_at=30,
                          agent={"snapshot_every": 10}))
    # NaN on the very last step, and the script ends without close(): the incident's capture
    # (written on a daemon thread) must be finished at exit, not cut off.
    noclose = run_once(dict(run_id="noclose", runs_dir=str(runs), steps=25, nan_at=24, skip_close=True,
                            agent={"snapshot_every": 10, "post_steps": 2}))
    _, err = crash.communicate(timeout=120)
    assert crash.returncode == 1
    assert b"RuntimeError: planted failure at step 30" in err  # the previous excepthook still prints it
    [cap] = _captures(runs / "exc", "crash")
    info = check_capture(cap)
    assert info["message"] == "RuntimeError: planted failure at step 30" and info["first_step"] == 29
    assert _end_reason(runs / "exc") == "crashed"

    _, err = noclose.communicate(timeout=120)
    assert noclose.returncode == 0, err.decode()[-2000:]
    [cap] = _captures(runs / "noclose", "nonfinite")
    assert check_capture(cap)["first_step"] == 24
    assert not list((runs / "noclose").glob("*.tmp"))
    assert _end_reason(runs / "noclose") == "finished"


def test_disk_ring_sigkill_leaves_a_replayable_crash_capture(zygote, tmp_path):
    """SIGKILL (what the OOM killer sends) gives no chance to write anything: with
    ``disk_ring=True`` the ring is already on disk, and ``sentineld recover`` (or the daemon)
    turns it into a crash capture that the replay rebuilds bit for bit."""
    runs = tmp_path / "runs"
    marker = tmp_path / "at-step"
    pid = zygote.train(run_id="ring", runs_dir=str(runs), steps=100_000, sleep_s=0.005, marker=str(marker),
                       marker_step=47, recipe="tests.reliability.zygote:make_recipe", hidden=64,
                       agent={"snapshot_every": 10, "window": 32, "disk_ring": True, "flush_s": 0.05})
    wait_until(marker.exists, 60, "step 47")
    time.sleep(0.3)
    ring = next((runs / "ring").glob("ring-rank0-*"))
    # Bounded on disk: at most 2 snapshots and `window` steps, plus those sharing a segment (K = 8
    # records each for window 32): 5 segments.
    assert len(list(ring.glob("snap-*.ring"))) <= 2 and 1 <= len(list(ring.glob("steps-*.ring"))) <= 5
    os.kill(pid, signal.SIGKILL)
    assert zygote.reap(pid) == -signal.SIGKILL
    assert _captures(runs / "ring") == []  # the process wrote nothing on its way out

    out = subprocess.run([sys.executable, "-m", "sentineld", "recover", str(runs / "ring")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [cap] = _captures(runs / "ring", "crash")
    info = check_capture(cap)
    last = check_stream(runs / "ring" / "stream-rank0.jsonl")[-1]["step"]
    assert info["first_step"] >= last - 1 and info["first_step"] >= 47  # at most the step in flight is lost
    assert info["snapshot_step"] % 10 == 0 and "on-disk ring" in info["message"]
    assert info["records"] == len(info["steps"])
    assert not (ring.exists())

    rep = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(runs / "ring"), "--capture", str(cap),
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    assert report["reproduced"] is True and report["phase"] == "none"
    assert report["step"] == info["first_step"]


def test_disk_ring_sigkill_mid_training_recovers_the_batches_that_were_trained(zygote, tmp_path):
    """Issue 23: the steps are appended to segment files, and a SIGKILL lands wherever it lands
    (here without a sleep between steps, so most likely while a record is being appended): the
    crash capture holds every step from its snapshot on, each batch equal to the one trained and
    each record equal to the stream's."""
    runs = tmp_path / "runs"
    marker = tmp_path / "at-step"
    pid = zygote.train(run_id="segkill", runs_dir=str(runs), steps=100_000, marker=str(marker), marker_step=70,
                       hidden=64, agent={"snapshot_every": 10, "window": 32, "disk_ring": True, "flush_s": 0.05})
    wait_until(marker.exists, 60, "step 70")
    os.kill(pid, signal.SIGKILL)
    assert zygote.reap(pid) == -signal.SIGKILL
    from sentineld.contracts.capture import open_capture
    from sentineld.daemon.ring_recovery import recover_run

    [cap_path] = recover_run(runs / "segkill")
    stream = {o["step"]: o for o in check_stream(runs / "segkill" / "stream-rank0.jsonl")}
    with open_capture(cap_path) as cap:
        steps = cap.steps
        assert steps[0] == cap.snapshot_step and steps[0] % 10 == 0 and steps[-1] >= 70
        assert steps[-1] - steps[0] < 32 + 10
        import torch

        g = torch.Generator().manual_seed(1)  # the zygote's data: randn(32, 64), randint(10, (32,)) a step
        trained = {n: (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
                   for n in range(steps[-1] + 1)}
        for n in steps:
            x, y = cap.step(n).batch
            assert torch.equal(x, trained[n][0]) and torch.equal(y, trained[n][1]), n
        records = cap.records()
        assert [r["step"] for r in records] == steps[:len(records)] and len(records) >= len(steps) - 1
        for r in records:
            if r["step"] in stream:
                assert r["loss"] == stream[r["step"]]["loss"], r["step"]
    assert not list((runs / "segkill").glob("ring-*"))
