"""Lightning: a real Trainer with SentineldCallback, planted faults, and the replay's verdict
from `sentineld replay <run> --json` with no recipe written by the user.

The LightningModule lives in the training script (``__main__``), the Trainer behind
``if __name__ == "__main__":``; the replay loads the class from the script without training.
All runs train in one subprocess (one Lightning import), each replay is its own subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

from .helpers import ENV, LIT_TRAIN, first_nonfinite_step, replay, stream, train, verdict

pytest.importorskip("lightning")

FAULT_STEP = 5

# run id -> (spec, expected (step, phase, module, module_type, op, reproduced))
CASES = {
    "data": ("data:1", (FAULT_STEP, "data", None, None, None, True)),
    "forward-accum2": ("forward:2", (FAULT_STEP, "forward", "norm", "Standardize", "aten.div", True)),
    "loss-bf16": ("loss:1:bf16-mixed", (FAULT_STEP, "forward", None, None, "aten.div", True)),  # outside the model
    "backward-accum3-bf16": ("backward:3:bf16-mixed", (FAULT_STEP, "backward", "root", "Root", "aten.sqrt", True)),
    # The scheduler's 5th step (at the end of step 4) returns an infinite LR factor.
    "optimizer": ("optimizer:1", (FAULT_STEP - 1, "optimizer", None, "LambdaLR", "lr", True)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs_dir = tmp_path_factory.mktemp("lit-runs")
    specs = [f"{run_id}:{spec}" for run_id, (spec, _) in CASES.items()] + ["crash:crash:1"]
    train(LIT_TRAIN, runs_dir, *specs, timeout=600)
    return runs_dir


@pytest.mark.slow
@pytest.mark.parametrize("run_id", list(CASES))
def test_planted_fault_is_named_by_the_replay(runs: Path, run_id: str) -> None:
    run_dir = runs / run_id
    code, report, err = replay(run_dir)
    assert code == 0, err
    assert verdict(report) == CASES[run_id][1], report
    assert report["steps_rebuilt"] >= 1  # from the snapshot, through re-executed steps
    if run_id == "data":
        assert report["evidence"]["field"] == "batch['batch'][0]"
        assert report["evidence"]["samples"] == [3]
    if "bf16" in run_id:
        assert report["evidence"]["precision"]["autocast_dtype"] == "bfloat16"
    # The recorded loss is training_step's raw loss, not Lightning's loss / accumulate_grad_batches.
    rec = next(r for r in stream(run_dir) if r.get("kind") == "step" and r["step"] == 0)
    assert rec["loss"] == report["evidence"]["rebuilt_losses"]["0"]


@pytest.mark.slow
def test_run_json_names_the_script_class_and_hyperparameters(runs: Path) -> None:
    meta = json.loads((runs / "forward-accum2" / "run.json").read_text())
    assert meta["recipe"] == "sentineld.integrations.lightning_replay:recipe_from_run"
    args = meta["recipe_args"]
    assert args["module_class"] == {"module": "__main__", "qualname": "TinyClassifier",
                                    "script": str(LIT_TRAIN)}
    assert args["hparams"] == {"width": 8, "classes": 3, "lr": 0.05, "fault": "forward", "fault_step": 5}
    assert (args["accumulate_grad_batches"], args["gradient_clip_val"], args["precision"]) == (2, 5.0, "32-true")
    # Steps are Lightning's global steps; with accumulation each holds the list of micro-batches.
    steps = [r["step"] for r in stream(runs / "forward-accum2") if r.get("kind") == "step"]
    assert steps == list(range(FAULT_STEP + 4))
    assert first_nonfinite_step(runs / "forward-accum2") == FAULT_STEP


@pytest.mark.slow
def test_replay_loads_the_script_without_running_its_training(runs: Path) -> None:
    before = sorted(p.name for p in runs.iterdir())
    code, report, err = replay(runs / "data")
    assert code == 0, err
    # The script's __main__ block (a Trainer writing a new run) did not run.
    assert sorted(p.name for p in runs.iterdir()) == before
    assert "Trainer.fit" not in err and "GPU available" not in err


@pytest.mark.slow
def test_an_exception_in_fit_writes_the_crash_capture(runs: Path) -> None:
    caps = sorted(p.name for p in (runs / "crash").glob("capture-*.h5"))
    assert caps == [f"capture-rank0-step{FAULT_STEP - 1:09d}-crash.h5"]
    end = [r for r in stream(runs / "crash") if r.get("kind") == "end"]
    assert end and end[-1]["reason"] == "crashed"


NO_HPARAMS = '''
import sys, torch, lightning.pytorch as pl
from sentineld.integrations.lightning import SentineldCallback

class NoHparams(pl.LightningModule):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, 1)
    def training_step(self, batch, batch_idx):
        return self.fc(batch[0]).mean() * batch[0].sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    x = torch.randn(32, 4)
    x[20] = float("nan")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    pl.Trainer(max_steps=7, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[SentineldCallback(run_id="nohp", runs_dir=sys.argv[1],
               metrics_port=0)]).fit(NoHparams(4), loader)
'''


@pytest.mark.slow
def test_without_save_hyperparameters_the_replay_says_what_to_add(tmp_path: Path) -> None:
    script = tmp_path / "nohp.py"
    script.write_text(NO_HPARAMS)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "never called self.save_hyperparameters()" in out.stderr  # said at training start too
    code, report, err = replay(tmp_path / "runs" / "nohp")
    assert code == 2 and report is None
    assert "NoHparams.__init__ takes ['width']" in err
    assert "add `self.save_hyperparameters()` as the first line of NoHparams.__init__" in err
    assert len(err.strip().splitlines()) == 1, err  # one clear message, no traceback


@pytest.mark.slow
def test_a_group_writable_script_is_not_loaded(runs: Path, tmp_path: Path) -> None:
    # A copy of the run naming a copy of the script that another user could have changed.
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    for p in (runs / "data").iterdir():
        (run / p.name).write_bytes(p.read_bytes())
        os.chmod(run / p.name, 0o600)
    script = tmp_path / "lit_train.py"
    script.write_text(LIT_TRAIN.read_text())
    meta = json.loads((run / "run.json").read_text())
    meta["recipe_args"]["module_class"]["script"] = str(script)
    (run / "run.json").write_text(json.dumps(meta))
    os.chmod(script, 0o664)
    code, _, err = replay(run)
    assert code == 2 and "writable by group or others" in err and str(script) in err
    code, report, err = replay(run, "--trust")  # the replay's --trust reaches the script check too
    assert code == 0 and report["phase"] == "data", err
    os.chmod(script, 0o600)
    code, report, err = replay(run)
    assert code == 0 and report["phase"] == "data", err


def test_unknown_or_trainer_owned_keywords_fail_when_the_callback_is_built() -> None:
    from sentineld.integrations.lightning import SentineldCallback

    with pytest.raises(ValueError, match=r"unknown agent setting\(s\) \['snapshot_evry'\]"):
        SentineldCallback(snapshot_evry=5)
    with pytest.raises(ValueError, match=r"\['accumulation_steps'\] come from the trainer"):
        SentineldCallback(accumulation_steps=2)


def test_both_import_names_accept_the_callback() -> None:
    import lightning.pytorch as lp
    import pytorch_lightning as pl

    from sentineld.integrations.lightning import SentineldCallback

    for pkg in (lp, pl):
        trainer = pkg.Trainer(callbacks=[SentineldCallback(metrics_port=0)], logger=False,
                              enable_checkpointing=False, enable_progress_bar=False)
        assert any(isinstance(c, SentineldCallback) for c in trainer.callbacks)


@pytest.mark.slow
def test_the_standalone_pytorch_lightning_package_replays_too(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    out = subprocess.run([sys.executable, str(LIT_TRAIN), str(tmp_path), "pl:forward:1"], cwd=REPO,
                         env={**ENV, "LIT_PACKAGE": "pytorch_lightning"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "pl" / "run.json").read_text())["recipe_args"]["lightning"] == "pytorch_lightning"
    code, report, err = replay(tmp_path / "pl")
    assert code == 0, err
    assert verdict(report) == (FAULT_STEP, "forward", "norm", "Standardize", "aten.div", True)


@pytest.mark.slow
def test_ddp_ranks_share_one_run_from_the_trainer(tmp_path: Path) -> None:
    """strategy="ddp" on two CPU processes (gloo), no run id given: rank 0's default id is
    broadcast, so both ranks write into one run directory, each stream labelled by its rank."""
    out = subprocess.run([sys.executable, str(LIT_TRAIN), str(tmp_path), "-:data:1"], cwd=REPO,
                         env={**ENV, "LIT_DEVICES": "2"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = list(tmp_path.iterdir())
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert (run / "run-rank1.json").exists()
    first: dict[int, dict] = {}
    for rank in (0, 1):
        recs = [json.loads(x) for x in (run / f"stream-rank{rank}.jsonl").read_text().splitlines()]
        steps = [r for r in recs if r.get("kind") == "step"]
        assert [r["step"] for r in steps] == list(range(FAULT_STEP + 4))
        assert {r["rank"] for r in steps} == {rank}
        first[rank] = next(r for r in steps if r["loss"] != r["loss"] or r["grad_norm"] != r["grad_norm"])
    # One rank's batch holds the NaN (its loss is NaN); the all-reduce makes the other rank's
    # gradient norm NaN at the same step while its own loss is finite.
    bad = next(r for r in (0, 1) if first[r]["loss"] != first[r]["loss"])
    other = 1 - bad
    assert first[other]["step"] == first[bad]["step"] and first[other]["loss"] == first[other]["loss"]
    code, report, err = replay(run)
    assert code == 0, err
    assert (report["rank"], report["step"], report["phase"], report["reproduced"]) == \
        (bad, first[bad]["step"], "data", True)


RESUME = '''
import sys, tempfile, torch, lightning.pytorch as pl
from lit_train import BATCH, FAULT_STEP, TinyClassifier, make_data
from sentineld.integrations.lightning import SentineldCallback

torch.manual_seed(0)
torch.set_num_threads(1)
steps = FAULT_STEP + 4
loader = torch.utils.data.DataLoader(make_data("forward", 1, steps), batch_size=BATCH)
kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
          enable_model_summary=False, num_sanity_val_steps=0)
with tempfile.TemporaryDirectory() as ckpt:
    # A first job without sentineld stops after 3 steps and leaves a checkpoint ...
    first = pl.Trainer(max_steps=3, default_root_dir=ckpt, **kw)
    first.fit(TinyClassifier(fault="forward"), loader)
    path = first.checkpoint_callback.best_model_path or first.checkpoint_callback.last_model_path
    # ... the resumed job, with the callback, starts at global step 3.
    pl.Trainer(max_steps=steps, enable_checkpointing=False,
               callbacks=[SentineldCallback(run_id="resumed", runs_dir=sys.argv[1], metrics_port=0)],
               **kw).fit(TinyClassifier(fault="forward"), loader, ckpt_path=path)
'''


@pytest.mark.slow
def test_a_resumed_fit_numbers_steps_by_global_step_and_imports_a_module_class(tmp_path: Path) -> None:
    """The module class lives in an importable module (lit_train, next to the script), not in
    __main__: the replay imports it from the run's working directory after the trust checks."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    here = LIT_TRAIN.parent
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], cwd=here,
                         env={**ENV, "PYTHONPATH": str(here)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "runs" / "resumed"
    args = json.loads((run / "run.json").read_text())["recipe_args"]
    assert args["module_class"] == {"module": "lit_train", "qualname": "TinyClassifier", "script": None}
    steps = [r["step"] for r in stream(run) if r.get("kind") == "step"]
    assert steps == list(range(3, FAULT_STEP + 4))
    # The resumed epoch starts again at batch 0 (a plain DataLoader cannot fast-forward), so the
    # fault's batch (index 5) is trained at global step 3 + 5.
    nan_step = 3 + FAULT_STEP
    assert first_nonfinite_step(run) == nan_step
    code, report, err = replay(run)
    assert code == 0, err
    assert verdict(report) == (nan_step, "forward", "norm", "Standardize", "aten.div", True)
    assert report["evidence"]["snapshot_step"] == 3 and report["steps_rebuilt"] == nan_step - 3
