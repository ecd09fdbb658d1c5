"""``sentineld replay RUN --world-size N``: an FSDP2 run's replay re-launched through torchrun
(gloo, 2 ranks), each rank loading its own shard of the capture's DCP checkpoint into the
recipe's model sharded again, must give the consolidated replay's phase, module, op, step and
ranks, reproduced bit for bit, and say how it was replayed (``replayed_as``). The runs are those
of :mod:`tests.e2e.test_fsdp_replay` (fault on rank 1 at step 7, snapshot at 4); bad requests
fail fast with a message saying what to do, and the relaunch never outlives its timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentineld.replay.engine import replay_run
from sentineld.replay.errors import ReplayError
from sentineld.replay.fsdp_relaunch import combine, read_outcome, relaunch
from tests.conftest import REPO
from tests.e2e.ddp_model import train_one_process
from tests.e2e.test_ddp_replay import EXPECTED, FAULT_STEP, SNAPSHOT, STEPS
from tests.e2e.test_fsdp_replay import TRAIN

FAULTS = ("data", "forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("relaunch")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(TRAIN), str(runs), "r2", "1", str(FAULT_STEP), str(STEPS), *FAULTS], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", "replay", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_relaunched_replay_gives_the_consolidated_verdict(runs: Path, fault: str) -> None:
    run = runs / f"r2-{fault}"
    t0 = time.perf_counter()
    out = _cli(str(run), "--world-size", "2", "--json")
    relaunched_s = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    phase, module, op, node = EXPECTED[fault]
    assert (got["phase"], got["module"], got["op"], got["autograd_node"]) == (phase, module, op, node), got
    ranks = [0, 1] if fault == "optimizer" else [1]
    assert got["step"] == FAULT_STEP and got["ranks"] == ranks and got["rank"] == ranks[0]
    assert got["evidence"]["snapshot_step"] == SNAPSHOT
    # Real FSDP collectives on the recorded batches: every rank's rebuilt loss is its recorded one, bit for bit.
    assert got["reproduced"] is True and got["max_loss_deviation"] == 0.0 and got["loss_tolerance"] == 0.0
    fsdp = got["evidence"]["fsdp"]
    assert got["replayed_as"] == "relaunched at world size 2" == fsdp["replayed_as"] and fsdp["state"] == "relaunched"
    assert fsdp["world_size"] == 2 and fsdp["ranks_used"] == [0, 1] and fsdp["bitwise"] is True
    assert fsdp["sharded_tensors"] == 3 * 7  # every parameter and both Adam moments came from the shards
    assert set(fsdp["per_rank"]) == {"0", "1"}
    if fault == "data":
        assert got["evidence"]["samples"] == [3] and got["evidence"]["fields"][0]["rank"] == 1
    if fault == "optimizer":
        assert got["evidence"]["state_entry"] == "exp_avg_sq"
    if fault == "backward":
        assert got["evidence"]["primitive"] == "aten.div"
    t0 = time.perf_counter()
    cons = replay_run(run)
    consolidated_s = time.perf_counter() - t0
    assert cons.replayed_as == "consolidated" and cons.evidence["fsdp"]["state"] == "consolidated"
    assert (cons.phase, cons.module, cons.op, cons.autograd_node, cons.step, cons.ranks, cons.reproduced) == \
        (got["phase"], got["module"], got["op"], got["autograd_node"], got["step"], got["ranks"], got["reproduced"])
    print(f"{fault}: relaunched {relaunched_s:.1f} s (CLI, wall), consolidated {consolidated_s:.1f} s (in process)")


@pytest.mark.slow
def test_relaunch_text_verdict_and_bad_world_sizes(runs: Path) -> None:
    run = runs / "r2-forward"
    for n, says in ((0, "--world-size must be >= 1"), (3, "ran on 2 ranks")):
        out = _cli(str(run), "--world-size", str(n))
        assert out.returncode == 2 and says in out.stderr and "omit" in out.stderr, out.stderr
    out = _cli(str(run), "--world-size", "2", "--rank", "1")
    assert out.returncode == 2 and "drop --rank" in out.stderr, out.stderr
    with pytest.raises(ReplayError, match="did not finish within 1 s"):
        relaunch(run, 2, timeout_s=1.0)  # killed, not waited on: the replay never hangs


def test_relaunch_of_an_unsharded_run_says_to_omit_world_size(tmp_path: Path) -> None:
    train_one_process(tmp_path, "plain", "forward", snapshot_every=2, recipe="tests.e2e.ddp_model:make_recipe")
    with pytest.raises(ReplayError, match="is not sharded .* omit --world-size"):
        relaunch(tmp_path / "plain", 1)
    assert replay_run(tmp_path / "plain").replayed_as is None  # only a sharded run's verdict says how


def test_combine_picks_the_earliest_phase_that_names_an_op() -> None:
    none = {"phase": "none", "module": None, "op": None}
    through_rs = {"phase": "backward", "module": None, "op": None}  # NaN arrived by the reduce-scatter
    assert combine([none, none], 2) == (0, [])
    assert combine([through_rs, {"phase": "forward", "module": "fc1", "op": "aten.addmm"}], 2) == (1, [1])
    assert combine([through_rs, {"phase": "backward", "module": "norm", "op": "aten.sqrt"}], 2) == (1, [1])
    opt = {"phase": "optimizer", "module": None, "op": "aten.addcmul_"}
    assert combine([none, opt, none], 3) == (1, [0, 1, 2])
    fwd = {"phase": "forward", "module": "fc1", "op": "aten.addmm"}
    assert combine([fwd, fwd], 2) == (0, [0, 1])


def test_a_verdict_written_before_a_teardown_abort_stands(tmp_path: Path) -> None:
    """Regression (CI at c62729c): a rank of a finished gloo job aborted in its teardown (SIGABRT,
    torchrun's exit code 1); the verdict rank 0 wrote after every rank's finding was gathered is
    the replay's, while a rank's written error or a missing verdict is still a failure."""
    verdict = {"run_id": "r2-forward", "phase": "forward", "module": "fc1", "step": FAULT_STEP}
    (tmp_path / "verdict.json").write_text(json.dumps(verdict))
    aborted = "terminate called without an active exception\n... exitcode  : -6 (pid: 21159)  (SIGABRT)"
    assert read_outcome(tmp_path, 2, 1, aborted) == verdict
    (tmp_path / "error-rank1.txt").write_text("rank 1: the checkpoint has no shard for fc1.weight")
    with pytest.raises(ReplayError, match="failed on rank1: rank 1: the checkpoint has no shard"):
        read_outcome(tmp_path, 2, 2, "")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReplayError, match="(?s)exited 1 without a verdict; torchrun said: .*SIGABRT"):
        read_outcome(empty, 2, 1, aborted)
