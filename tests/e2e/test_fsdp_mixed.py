"""An FSDP2 run in mixed precision (every unit ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, 2 ranks, gloo; :mod:`tests.e2e.fsdp_mixed_train`): the agent records
the run's units and their policies in run.json, the relaunch at the recorded world size shards
the recipe's model into the same units with the same policies and reproduces every rank's losses
bit for bit, and the consolidated replay (which computes in float32) says its losses are not the
run's and how to get them. A malformed record is refused with its reason, never silently used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.errors import BadInput
from sentineld.contracts.fsdpunits import read_units
from sentineld.contracts.render import render_verdict
from sentineld.replay.engine import replay_run
from tests.conftest import REPO
from tests.e2e.test_ddp_replay import FAULT_STEP, SNAPSHOT, STEPS

TRAIN = Path(__file__).with_name("fsdp_mixed_train.py")
BF16_F32 = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None, "cast_forward_inputs": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("mixed")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(TRAIN), str(runs), "m2", "1", str(FAULT_STEP), str(STEPS), "data", "optimizer"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs


def _relaunch(run: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run), "--world-size", "2", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_run_records_its_units_and_their_policies(runs: Path) -> None:
    extra = json.loads((runs / "m2-data" / "run.json").read_text())["extra"]
    assert extra["fsdp_units"] == [{"module": m, **BF16_F32} for m in ("", "fc1", "head")]
    assert [u.module for u in read_units(extra) or []] == ["", "fc1", "head"]


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "phase", "op"), [("data", "data", None), ("optimizer", "optimizer", "aten.addcmul_")])
def test_relaunch_applies_the_policies_and_reproduces_bit_for_bit(runs: Path, fault: str, phase: str,
                                                                   op: str | None) -> None:
    got = _relaunch(runs / f"m2-{fault}")
    assert (got["phase"], got["op"], got["step"]) == (phase, op, FAULT_STEP), got
    assert got["evidence"]["snapshot_step"] == SNAPSHOT
    assert got["reproduced"] is True and got["max_loss_deviation"] == 0.0, got
    fsdp = got["evidence"]["fsdp"]
    assert fsdp["units"] == [{"module": m, **BF16_F32} for m in ("", "fc1", "head")]
    assert [u["module"] for u in fsdp["mixed_precision"]] == ["", "fc1", "head"]
    text = render_verdict(got)[1]
    assert "mixed precision: applied as the run had it (param bfloat16, reduce float32) on units <root>, fc1, head" \
        in text, text


@pytest.mark.slow
def test_consolidated_replay_says_its_losses_are_not_the_runs_and_how_to_get_them(runs: Path) -> None:
    run = runs / "m2-optimizer"
    cons = replay_run(run)
    assert (cons.phase, cons.op, cons.step) == ("optimizer", "aten.addcmul_", FAULT_STEP)
    # float32 compute of a bfloat16 run: the rebuilt losses differ (why the relaunch exists).
    assert cons.reproduced is False and cons.max_loss_deviation > 0
    fsdp = cons.evidence["fsdp"]
    assert [u["module"] for u in fsdp["mixed_precision"]] == ["", "fc1", "head"]
    assert fsdp["relaunch"] == f"sentineld replay {run} --world-size 2"
    text = render_verdict(cons)[1]
    assert ("mixed precision: the run computed units <root>, fc1, head with param bfloat16, reduce float32; this "
            f"consolidated replay computes in the parameters' dtype, so its losses are not the run's: "
            f"sentineld replay {run} --world-size 2 applies the policies") in text, text


@pytest.mark.slow
def test_a_malformed_units_record_is_refused_with_its_reason(runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "m2-optimizer"
    shutil.copytree(runs / "m2-optimizer", run)
    for name in ("run.json", "run-rank1.json"):
        meta = json.loads((run / name).read_text())
        meta["extra"]["fsdp_units"] = [{"module": "fc1", "param_dtype": "float8_evil"}]
        (run / name).write_text(json.dumps(meta))
    cons = replay_run(run)  # the consolidated replay goes on and says what it ignored
    assert cons.phase == "optimizer" and "mixed_precision" not in cons.evidence["fsdp"]
    assert "extra.fsdp_units [0].param_dtype is 'float8_evil'" in cons.evidence["fsdp"]["units_problem"]
    assert "warning: run.json: extra.fsdp_units [0].param_dtype is 'float8_evil'" in render_verdict(cons)[1]
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run), "--world-size", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2 and "extra.fsdp_units [0].param_dtype is 'float8_evil'" in out.stderr, out.stderr


@pytest.mark.parametrize(("raw", "says"), [
    ({"module": ""}, "is a dict, not a list"),
    (["fc1"], "[0] is not an object with a string module"),
    ([{"module": "fc1", "reduce_dtype": "int8"}], "[0].reduce_dtype is 'int8'"),
    ([{"module": "fc1", "cast_forward_inputs": "yes"}], "[0].cast_forward_inputs is 'yes', not a boolean"),
])
def test_read_units_refuses_what_the_agent_never_writes(raw: object, says: str) -> None:
    with pytest.raises(BadInput, match="extra.fsdp_units " + re.escape(says)):
        read_units({"fsdp_units": raw})
    assert read_units({}) is None
