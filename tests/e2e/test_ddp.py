"""torch.distributed (DDP, gloo, 2 processes on CPU): each rank writes its own stream and
capture, metrics carry the rank label, and the daemon treats the ranks as one run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentineld.contracts.capture import open_capture
from tests.conftest import REPO, get_free_port, wait_until

DDP = Path(__file__).with_name("ddp_train.py")


@pytest.mark.slow
def test_ddp_ranks_stream_capture_and_alert_as_one_run(daemon_factory):
    daemon = daemon_factory(extra=["--no-replay"])
    subprocess.run([sys.executable, str(DDP), str(daemon.runs_dir), "ddp-run", str(get_free_port()), "12", "20"],
                   cwd=REPO, check=True, timeout=180)
    run = daemon.runs_dir / "ddp-run"
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert (run / "run-rank1.json").exists()
    firsts = {}
    for rank in (0, 1):
        steps = [json.loads(x) for x in (run / f"stream-rank{rank}.jsonl").read_text().splitlines()]
        recs = [s for s in steps if s["kind"] == "step"]
        assert len(recs) == 20 and all(r["rank"] == rank for r in recs)
        firsts[rank] = next(r for r in recs if r["loss"] != r["loss"] or r["grad_norm"] != r["grad_norm"])
    # The NaN sits in rank 1's batch: its loss is NaN at step 12; all-reduced gradients make
    # rank 0's grad norm NaN at the same step while its own loss is still finite.
    assert firsts[1]["step"] == 12 and firsts[1]["loss"] != firsts[1]["loss"]
    assert firsts[0]["step"] == 12 and firsts[0]["loss"] == firsts[0]["loss"]
    caps = sorted(run.glob("capture-*.h5"))
    assert [c.name for c in caps] == ["capture-rank0-step000000012-nonfinite.h5",
                                      "capture-rank1-step000000012-nonfinite.h5"]
    with open_capture(caps[1]) as cap:
        assert cap.rank == 1 and "module." not in "".join(cap.snapshot()["model"])
    notes = wait_until(lambda: [n for n in daemon.notifications() if n["run"] == "ddp-run"], 30, "the alert")
    time.sleep(2)
    notes = [n for n in daemon.notifications() if n["run"] == "ddp-run" and n["kind"] == "alert"]
    assert len(notes) == 1, notes  # one alert for the run, not one per rank
    assert notes[0]["data"]["ranks"] == [1, 0] or sorted(notes[0]["data"]["ranks"]) == [0, 1]
    assert "rank(s): 0,1" in notes[0]["body"]


@pytest.mark.slow
def test_ddp_replay_names_the_rank_whose_own_loss_went_nonfinite(tmp_path):
    runs = tmp_path / "runs"
    subprocess.run([sys.executable, str(DDP), str(runs), "ddp-replay", str(get_free_port()), "3", "6"],
                   cwd=REPO, check=True, timeout=180)
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(runs / "ddp-replay"), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    report = json.loads(out.stdout)
    assert report["rank"] == 1 and report["step"] == 3
    assert report["phase"] == "data" and report["evidence"]["samples"] == [3]
    # Rank 0's capture of the same step shows only the all-reduced NaN gradient.
    out0 = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(runs / "ddp-replay"), "--rank", "0",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert json.loads(out0.stdout)["rank"] == 0
