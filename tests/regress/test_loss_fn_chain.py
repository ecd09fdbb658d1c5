"""Issue 22 item 1 and issue 20 item 11: a plain loop attached the README's way (``loss_fn=``, no
recipe) gets the whole chain, and its localization never stalls training.

All fail on 49179bb: there ``sentineld replay <run> --step N`` and ``sentineld regress <run>`` exit
2 ("recorded no recipe"), the in-process copy of ``StaticScaleAdam(params, lr, loss_scale)`` fails,
and a loss_fn holding the GIL stalls the training loop for as long as each call takes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.verdict_file import verdict_path
from tests.regress import lossfn_project as lp


def _cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def _capture(run_dir: Path) -> Path:
    caps = sorted(run_dir.glob("capture-*-nonfinite.h5"))
    assert len(caps) == 1, list(run_dir.iterdir())
    return caps[0]


@pytest.mark.slow
def test_loss_fn_run_gets_verdict_replay_and_a_movable_regression_test(tmp_path: Path) -> None:
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", CLOSE_WAIT_S="240")
    run_dir = run["run_dir"]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["recipe"] is None and meta["extra"]["localize"] == "process"

    # The training process's own verdict (made in a child process), despite the optimizer's
    # required constructor argument.
    own = json.loads(verdict_path(_capture(run_dir)).read_text())
    assert own.get("result") != "failed", own
    assert (own["phase"], own["op"], own["step"], own["module_type"]) == ("forward", "aten.mul", lp.NAN_STEP, "CountNet")
    assert own["evidence"]["in_process"]["mode"] == "process"
    assert own["evidence"]["samples"] == [lp.BAD_ROW]  # the record to look at

    # The command the alert prints works without a recipe, and agrees.
    r = _cli("replay", str(run_dir), "--step", str(lp.NAN_STEP), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["phase"], rep["op"], rep["module_type"], rep["reproduced"]) == ("forward", "aten.mul", "CountNet", True)
    assert rep["steps_rebuilt"] == lp.NAN_STEP  # snapshot at 0: steps 0..4 re-executed bit for bit
    assert rep["evidence"]["samples"] == [lp.BAD_ROW]
    text = _cli("replay", str(run_dir), "--step", str(lp.NAN_STEP)).stdout
    assert f"samples: [{lp.BAD_ROW}]" in text

    # The regression test, written into the project, then the project moved (a checkout elsewhere).
    r = _cli("regress", str(run_dir), "-o", str(project / "tests"), cwd=project)
    assert r.returncode == 0, r.stderr
    test = Path(r.stdout.splitlines()[0])
    assert str(project) not in test.read_text() + test.with_name(f"sentineld_counts_step{lp.NAN_STEP}.json").read_text()
    moved = tmp_path / "checkout"
    shutil.move(project, moved)
    shutil.rmtree(run_dir.parent)  # the run is gone too: the test needs only its three files
    mtest = moved / "tests" / test.name
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(mtest)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"step {lp.NAN_STEP}: the loss is" in bad.stdout
    lp.fix_bug(moved)
    good = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(mtest)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert good.returncode == 0 and "1 passed" in good.stdout, good.stdout + good.stderr


@pytest.mark.slow
def test_a_backward_verdict_names_the_sample(tmp_path: Path) -> None:
    """Issue 22: forward and backward verdicts say which rows of the batch went non-finite first."""
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", FAULT="backward", CLOSE_WAIT_S="240")
    v = json.loads(verdict_path(_capture(run["run_dir"])).read_text())
    assert (v["phase"], v["op"], v["autograd_node"]) == ("backward", "aten.sqrt", "SqrtBackward0"), v
    assert v["evidence"]["samples"] == [lp.BAD_ROW]


@pytest.mark.slow
def test_a_loss_fn_holding_the_gil_does_not_stall_training(tmp_path: Path) -> None:
    """Each call of this loss_fn holds the GIL ~1-3 s here (one ``re.match``); the localization
    calls it once per replayed step. Training's steps meanwhile stay within a fraction of a
    second (on 49179bb, in a thread, each such call stalled a training step for as long)."""
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", HOG="gil", HOG_N="31", OPT="adam", STEPS="60", STEP_SLEEP="0.1",
                   CLOSE_WAIT_S="5")
    after = run["steps"][lp.NAN_STEP + 1:]
    assert max(after) < 1.0, f"a training step took {max(after):.2f} s while the loss_fn held the GIL"
    assert run["close_s"] < 5 + 2 + 3
    assert verdict_path(_capture(run["run_dir"])).exists()


@pytest.mark.slow
def test_close_waits_a_bounded_time_for_a_hung_loss_fn(tmp_path: Path) -> None:
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", HOG="hang", CLOSE_WAIT_S="2", OPT="adam")
    assert run["close_s"] < 2 + 5, run["close_s"]  # 120 s on 49179bb
    failed = json.loads(verdict_path(_capture(run["run_dir"])).read_text())
    assert failed["result"] == "failed" and "deadline" in failed["reason"]


@pytest.mark.slow
def test_forward_only_script_class_autocast_and_a_backward_fault(tmp_path: Path) -> None:
    """Issue 22, forward-only by hand: a model class of the training script with a constructor
    argument is rebuilt by ``sentineld replay``; the run's float16 autocast is honoured (the
    overflow exists only there); a backward fault's verdict does not deny the recorded NaN loss
    and says each sentence once. On 49179bb: "cannot be imported", "not checked" / phase none,
    "every value finite" with "recorded run non-finite here: False"."""
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", "fp16", NO_LOSS_FN="1", FAULT="fp16", AUTOCAST="float16")
    own = json.loads(verdict_path(_capture(run["run_dir"])).read_text())
    assert (own["phase"], own["module"], own["evidence"]["autocast_dtype"]) == ("forward", "fc1", "float16"), own
    r = _cli("replay", str(run["run_dir"]), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["phase"], rep["module"], rep["op"]) == (own["phase"], own["module"], own["op"])

    run = lp.train(project, tmp_path / "runs", "fwd-bwd", NO_LOSS_FN="1", FAULT="backward")
    own = json.loads(verdict_path(_capture(run["run_dir"])).read_text())
    assert own["phase"] == "none" and own["recorded_nonfinite"] is True
    r = _cli("replay", str(run["run_dir"]))
    text = r.stdout
    assert "every value finite" not in text and "recorded run non-finite here: True" in text, text
    sentences = [s.strip() for line in text.splitlines() for s in line.split(";") if len(s.strip()) > 30]
    assert len(sentences) == len(set(sentences)), text
