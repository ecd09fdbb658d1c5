"""DDP replica consistency (issue 25): a silent one-element change of one rank's replica is named
by the agent's replica check (checksums compared through the job's store every 25 steps, the
default) within 50 steps, with a ``replica_divergence`` capture on every rank; replicas that
stay equal raise nothing. Three ranks, so the changed one is the odd one out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO

TRAIN = Path(__file__).with_name("ddp_replica_train.py")
WORLD, CHANGE_RANK, CHANGE_STEP, STEPS, EVERY = 3, 1, 10, 30, 25


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("replicas")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(WORLD), str(TRAIN), str(runs), "rep", str(CHANGE_RANK), str(CHANGE_STEP), str(STEPS)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs


def _divergences(run: Path, rank: int) -> list[dict]:
    lines = [json.loads(x) for x in (run / f"stream-rank{rank}.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("kind") == "replica_divergence"]


@pytest.mark.slow
def test_silent_change_on_one_rank_is_named_within_50_steps(runs: Path) -> None:
    run = runs / "rep-silent"
    first_sample = (CHANGE_STEP // EVERY + 1) * EVERY  # the first sampled step after the change
    assert first_sample - CHANGE_STEP <= 50
    for r in range(WORLD):
        divs = _divergences(run, r)
        assert divs, f"rank {r} saw no divergence"
        d = divs[0]
        assert (d["step"], d["ranks"], d["parameter"]) == (first_sample, [CHANGE_RANK], "fc1.weight"), d
    caps = [(c[0], c[1], c[2]) for c in list_captures(run)]
    assert caps == [(r, first_sample, "replica_divergence") for r in range(WORLD)]


@pytest.mark.slow
def test_equal_replicas_raise_nothing(runs: Path) -> None:
    run = runs / "rep-clean"
    assert all(not _divergences(run, r) for r in range(WORLD))
    assert list_captures(run) == []
