"""Bad input on the recently added surfaces, as a careless user gives it: every case that broke
(a traceback, a misleading message, a replay failing on a junk field) with the input that broke
it. The rule: exit code 2 (a :class:`~sentineld.contracts.errors.BadInput`) with a message that
says what was wrong and what to do, never a traceback; a damaged verdict never costs the page.

- a relaunched (``--world-size``) and a consolidated FSDP2 replay of a run whose DCP shard file
  is truncated or replaced by garbage, or whose ``.metadata`` is garbage (DCP's
  ``CheckpointException`` is a ``BaseException``: ``except Exception`` let it through);
- ``--step`` that no capture of a multi-rank run holds (it said "copy the captures from the
  host that ran rank 0" and "pass --rank", which ``--world-size`` refuses);
- a compiled run whose run.json names a junk ``compile_backend`` (5: the replay failed with a
  TypeError) or an unknown one (the note blamed the minifier, not the name);
- ``sentineld preflight`` with a loss_fn returning a str (every check failed on an AttributeError);
- ``sentineld report`` with a verdict whose field has the wrong type (a traceback) or that is
  huge (said "cannot write the report").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sentineld.replay.engine import replay_run
from sentineld.replay.errors import ReplayError
from tests.conftest import REPO

FSDP_TRAIN = REPO / "tests" / "e2e" / "fsdp_faults_train.py"
DCP = "capture-step7-nonfinite-snap4.dcp"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _cli(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank FSDP2 run (torchrun, gloo) with a forward fault on rank 1 at step 7."""
    runs = tmp_path_factory.mktemp("badin-fsdp")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(FSDP_TRAIN), str(runs), "r2", "1", "7", "10", "forward"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs / "r2-forward"


def _damaged(run: Path, tmp: Path, name: str, how: str) -> Path:
    """A copy of ``run`` with one file of its DCP checkpoint damaged (the original stays whole)."""
    copy = tmp / name
    shutil.copytree(run, copy)
    if how == "truncate":
        with open(copy / DCP / "__1_0.distcp", "r+b") as f:
            f.truncate(1000)
    elif how == "garbage":
        shard = copy / DCP / "__0_0.distcp"
        shard.write_bytes(os.urandom(shard.stat().st_size))
    elif how == "metadata":
        (copy / DCP / ".metadata").write_text("garbage\n")
    return copy


def _says_recopy(text: str) -> None:
    assert "Traceback" not in text and "CheckpointException" not in text, text
    assert f"copy the whole {DCP}/ directory again" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "garbage", "metadata"])
def test_relaunch_of_a_damaged_dcp_checkpoint_says_to_copy_it_again(fsdp_run: Path, tmp_path: Path, how: str) -> None:
    run = _damaged(fsdp_run, tmp_path, f"r2-{how}", how)
    out = _cli("replay", str(run), "--world-size", "2")
    assert out.returncode == 2, out.stderr[-3000:]
    _says_recopy(out.stderr)
    part = ".metadata" if how == "metadata" else "shard files"
    assert f"the DCP checkpoint's {part} cannot be read" in out.stderr, out.stderr
    if how == "truncate":
        assert "rank 1: EOFError" in out.stderr, out.stderr  # the rank whose shard is short, in one line


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_consolidated_replay_of_a_damaged_shard_is_bad_input(fsdp_run: Path, tmp_path: Path, how: str) -> None:
    run = _damaged(fsdp_run, tmp_path, f"c-{how}", how)
    with pytest.raises(ReplayError) as exc:  # was an EOFError / UnpicklingError traceback, exit 1
        replay_run(run)
    _says_recopy(str(exc.value))


@pytest.mark.slow
@pytest.mark.parametrize("step", [99, -1, 2])
def test_a_step_no_capture_of_a_sharded_run_holds_names_the_held_steps(fsdp_run: Path, step: int) -> None:
    with pytest.raises(ReplayError) as exc:
        replay_run(fsdp_run, step)
    msg = str(exc.value)
    assert f"no capture holds step {step}" in msg and "hold steps 4..9" in msg and "pass --step" in msg, msg
    assert "--rank" not in msg and "Copy capture-rank" not in msg, msg  # no rank's files are missing
    out = _cli("replay", str(fsdp_run), "--world-size", "2", "--step", str(step))  # --rank is refused there
    assert out.returncode == 2 and f"no capture holds step {step}" in out.stderr and "--rank" not in out.stderr, \
        out.stderr


# --- compiled runs: a junk run.json extra.compile_backend -----------------------------------------


@pytest.fixture(scope="module")
def transient_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose non-finite step the eager replay does not make (the compiled re-run is tried)."""
    from tests.replay import spikecases as sc  # noqa: PLC0415

    cwd = os.getcwd()
    os.chdir(REPO)  # run.json's cwd: where tests.replay.spikecases is imported from
    try:
        return Path(sc.train("transient", tmp_path_factory.mktemp("badin-compiled") / "runs"))
    finally:
        os.chdir(cwd)


def _with_compiled(run: Path, tmp: Path, compiled: Any, backend: Any) -> Path:
    copy = tmp / "run"
    shutil.copytree(run, copy)
    meta = json.loads((copy / "run.json").read_text())
    meta["extra"].update(compiled=compiled, compile_backend=backend)
    (copy / "run.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.slow
def test_compiled_run_with_a_non_string_backend_still_replays(transient_run: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    run = _with_compiled(transient_run, tmp_path, True, 5)
    v = json.loads(replay_run(run).to_json())  # was: "re-executing the run's steps failed: TypeError", exit 2
    rerun = v["evidence"]["compiled"]["compiled_rerun"]
    assert rerun["backend"] == "inductor" and "error" not in rerun, rerun
    assert "compile_backend is 5, not a torch.compile backend name" in rerun["backend_note"], rerun


@pytest.mark.slow
def test_compiled_run_with_an_unknown_backend_says_to_fix_run_json(transient_run: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    run = _with_compiled(transient_run, tmp_path, True, "no-such-backend")
    rerun = json.loads(replay_run(run).to_json())["evidence"]["compiled"]["compiled_rerun"]
    assert "InvalidBackend" in rerun["error"], rerun
    note = rerun["repro_note"]  # was: the minifier "checks inductor graphs only", as if the name were fine
    assert "'no-such-backend' (run.json's extra.compile_backend) is not one this torch has" in note, note
    assert "write the backend the run compiled with there" in note, note


def test_a_truthy_string_compiled_flag_is_not_a_compiled_run() -> None:
    from sentineld.contracts.rundir import RunMeta  # noqa: PLC0415
    from sentineld.replay.cf_replay import run_compiled  # noqa: PLC0415

    for flag, want in (("yes", False), ("false", False), (True, True)):
        meta = RunMeta(run_id="r", extra={"compiled": flag})
        assert run_compiled(meta) is want, flag  # as the verdict's own check: only true is compiled


# --- preflight: a loss_fn returning something that is not a tensor ------------------------------

ODD_RECIPE = """
import torch
from torch import nn
from sentineld.recipe import Recipe

def loss_str():
    m = nn.Linear(4, 3)
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=lambda mod, b: "loss")

def loss_tuple():
    m = nn.Linear(4, 3)
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=lambda mod, b: (mod(b[0]).sum(), 1))

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
"""


@pytest.mark.parametrize(("fn", "got"), [("loss_str", "str"), ("loss_tuple", "tuple")])
def test_preflight_loss_fn_returning_no_tensor_is_bad_input(project: Any, fn: str, got: str) -> None:
    p = project(ODD_RECIPE)
    out = _cli("preflight", p.spec(fn), "--data", p.spec("data"), cwd=p.root, timeout=120)
    # was: exit 1, every check "could not run: AttributeError: 'str' object has no attribute 'detach'"
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"loss_fn returned {got}, not a tensor" in out.stderr and "scalar tensor" in out.stderr, out.stderr


# --- report: a damaged verdict ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished single-process run (4 finite steps, no capture)."""
    from tests.e2e.ddp_model import train_one_process  # noqa: PLC0415

    runs = tmp_path_factory.mktemp("badin-report")
    train_one_process(runs, "plain")
    return runs / "plain"


def test_report_with_a_wrongly_typed_verdict_field_writes_the_page(plain_run: Path, tmp_path: Path) -> None:
    bad = tmp_path / "v.json"
    bad.write_text(json.dumps({"phase": "forward", "step": 3, "what_if": 7, "evidence": []}))
    page = tmp_path / "r.html"
    out = _cli("report", str(plain_run), "--verdict", str(bad), "-o", str(page), timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]  # was a TypeError traceback
    html = page.read_text()
    assert "the verdict cannot be shown: a field has the wrong type" in html
    assert f"sentineld replay {plain_run} --json" in html and "Training curves" in html


def test_report_with_a_huge_verdict_file_says_what_a_verdict_is(plain_run: Path, tmp_path: Path) -> None:
    from sentineld.report.sources import MAX_VERDICT_FILE_BYTES  # noqa: PLC0415

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: over the limit without writing it
        f.truncate(MAX_VERDICT_FILE_BYTES + 1)
    out = _cli("report", str(plain_run), "--verdict", str(huge), "-o", str(tmp_path / "r.html"), timeout=120)
    assert out.returncode == 2, out.stderr
    assert "cannot write the report" not in out.stderr, out.stderr  # it was the verdict that could not be read
    assert "a verdict is a few KiB: pass the JSON of `sentineld replay --json`" in out.stderr, out.stderr


# --- attach(signatures=...) -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_attach_rejects_a_non_finite_signature_threshold(value: float) -> None:
    from sentineld.agent.wiring import check_signatures  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"loss_spike\.min_excess must be a finite number.*enabled"):
        check_signatures({"loss_spike": {"min_excess": value}})
