"""FSDP2 replay from every rank's capture: real ``fully_shard`` on a CPU mesh (gloo), 2 and 4
ranks started by torchrun, one planted fault per run on one rank (the faults, model and steps of
:mod:`tests.e2e.test_ddp_replay`: snapshot at S=4, fault at N=7).

Each verdict must name the right phase, module (the unsharded name), op, step and rank, and
reproduce every rank's recorded loss (bit for bit on 2 ranks); every rank wrote its shard of one
DCP checkpoint per incident, which reloads consolidated in one process and sharded over a job
of the original and of another world size, equal to the run's own parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sentineld.contracts.capture import open_capture
from sentineld.contracts.dcpstate import PLACEHOLDER, load_consolidated, placeholders
from sentineld.contracts.rundir import list_captures
from sentineld.replay.engine import replay_run
from tests.conftest import REPO
from tests.e2e.test_ddp_replay import EXPECTED, FAULT_STEP, SAMPLE, SNAPSHOT, STEPS

TRAIN = Path(__file__).with_name("fsdp_faults_train.py")
RELOAD = Path(__file__).with_name("fsdp_reload.py")
PARAMS = ("fc1.weight", "fc1.bias", "norm.scale", "bn.weight", "bn.bias", "head.weight", "head.bias")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _torchrun(world: int, script: Path, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(world), str(script), *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def runs2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("fsdp2")
    _torchrun(2, TRAIN, str(runs), "f2", "1", str(FAULT_STEP), str(STEPS), "data", "forward", "backward",
              "optimizer")
    return runs


@pytest.fixture(scope="module")
def runs4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("fsdp4")
    _torchrun(4, TRAIN, str(runs), "f4", "2", str(FAULT_STEP), str(STEPS), "forward", "optimizer")
    return runs


def _checkpoint(run: Path) -> Path:
    return run / f"capture-step{FAULT_STEP}-nonfinite-snap{SNAPSHOT}.dcp"


def _check(report: Any, fault: str, world: int, fault_rank: int) -> None:
    phase, module, op, node = EXPECTED[fault]
    assert (report.phase, report.module, report.op, report.autograd_node) == (phase, module, op, node), \
        report.to_json()[:3000]
    ranks = list(range(world)) if fault == "optimizer" else [fault_rank]
    assert report.ranks == ranks and report.rank == ranks[0]
    assert report.step == FAULT_STEP and report.evidence["snapshot_step"] == SNAPSHOT
    assert report.reproduced, report.to_json()[:3000]
    if world == 2:  # the reduce-scatter's sum of two ranks is reproduced bit for bit
        assert report.max_loss_deviation == 0.0 and report.loss_tolerance == 0.0
    else:
        assert report.max_loss_deviation <= report.loss_tolerance
    fsdp = report.evidence["fsdp"]
    assert fsdp["state"] == "consolidated" and Path(fsdp["checkpoint"]).name == _checkpoint(Path(report.capture).parent).name
    # Parameters and both Adam moments of every parameter came from the shards.
    assert fsdp["sharded_tensors"] == 3 * len(PARAMS)
    assert report.evidence["ddp"]["ranks_used"] == list(range(world))
    if fault == "data":
        assert report.evidence["samples"] == [SAMPLE] and report.evidence["fields"][0]["rank"] == fault_rank
    if fault == "optimizer":
        assert report.evidence["state_entry"] == "exp_avg_sq"


def _captures_are_sharded(run: Path, world: int) -> None:
    caps = list_captures(run)
    assert [(c[0], c[1]) for c in caps] == [(r, FAULT_STEP) for r in range(world)]
    ckpt = _checkpoint(run)
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(world))]
    for _r, _n, _t, path in caps:
        with open_capture(path) as cap:
            assert cap.sharded_state == ckpt.name
            snap = cap.snapshot()
            # No rank's HDF5 holds a parameter: each is a placeholder naming its DCP key.
            assert snap["model"]["fc1.weight"] == {PLACEHOLDER: "model/fc1.weight"}
            assert set(placeholders(snap)) >= {f"model/{p}" for p in PARAMS}
            assert isinstance(snap["optimizer"]["state"][0]["step"], torch.Tensor)  # unsharded: kept here


@pytest.mark.slow
@pytest.mark.parametrize("fault", ("data", "forward", "backward", "optimizer"))
def test_two_ranks_fsdp_fault_is_replayed_consolidated(runs2: Path, fault: str) -> None:
    run = runs2 / f"f2-{fault}"
    _captures_are_sharded(run, 2)
    meta = json.loads((run / "run.json").read_text())
    assert meta["extra"]["sharded"] == "fsdp2" and meta["extra"]["grad_norm"] == "local_shard"
    _check(replay_run(run), fault, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ("forward", "optimizer"))
def test_four_ranks_fsdp_fault_is_replayed_consolidated(runs4: Path, fault: str) -> None:
    run = runs4 / f"f4-{fault}"
    _captures_are_sharded(run, 4)
    _check(replay_run(run), fault, 4, 2)


def _truth(runs: Path, run_id: str) -> dict[str, torch.Tensor]:
    return torch.load(runs / f"{run_id}.truth.pt")


@pytest.mark.slow
def test_sharded_capture_reloads_at_world_size_one(runs2: Path, runs4: Path) -> None:
    for runs, run_id in ((runs2, "f2-forward"), (runs4, "f4-forward")):
        whole = load_consolidated(_checkpoint(runs / run_id))
        truth = _truth(runs, run_id)  # the parameters the run had before step S, gathered by the run
        assert {k.removeprefix("model/") for k in whole if k.startswith("model/")} == set(truth)
        for name, t in truth.items():
            assert torch.equal(whole[f"model/{name}"], t), name


@pytest.mark.slow
@pytest.mark.parametrize(("runs_name", "run_id", "world"), [("runs2", "f2-forward", 2), ("runs4", "f4-forward", 2)])
def test_sharded_capture_reloads_sharded(request: pytest.FixtureRequest, tmp_path: Path, runs_name: str,
                                         run_id: str, world: int) -> None:
    """At the original world size (2 ranks wrote it) and at another (4 wrote it, 2 read it)."""
    runs = request.getfixturevalue(runs_name)
    out = tmp_path / "reloaded.pt"
    _torchrun(world, RELOAD, str(_checkpoint(runs / run_id)), str(out))
    got = torch.load(out)
    assert got["world_size"] == world
    truth = _truth(runs, run_id)
    for name, t in truth.items():
        assert torch.equal(got["params"][name], t), name
