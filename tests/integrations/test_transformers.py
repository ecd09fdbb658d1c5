"""Hugging Face Trainer: a real Trainer (tiny BERT from a config, no download) with
SentineldCallback, planted faults, and the verdict of `sentineld replay <run> --json` with no
recipe written by the user. All runs train in one subprocess, each replay is its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .helpers import HF_TRAIN, first_nonfinite_step, replay, stream, train, verdict

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

FAULT_STEP = 3  # hf_train.py's: the fault is in the 4th optimizer step
#: Its step number: the Trainer's global_step once the step is done (as in its logs, checkpoint-4).
STEP = FAULT_STEP + 1
CASES = {
    "data": ("data:1", (STEP, "data", None, None, None, True)),
    "forward-accum2": ("forward:2", (STEP, "forward", "bert.embeddings.LayerNorm", "LayerNorm",
                                     "aten.native_layer_norm", True)),
    "loss-accum2-bf16": ("loss:2:bf16", (STEP, "forward", None, "CrossEntropyLoss",
                                         "aten.nll_loss_forward", True)),
    # The model class is the script's own (__main__), loaded from the script by the replay.
    "backward-accum2-script": ("backward:2", (STEP, "backward", "root", "Root", "aten.sqrt", True)),
    # adam_epsilon=0: the parameters whose gradient is exactly 0 get 0/0 at the first step.
    "optimizer": ("optimizer:1", (1, "optimizer", None, "AdamW",
                                  "aten._fused_adamw_", True)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs_dir = tmp_path_factory.mktemp("hf-runs")
    specs = [f"{run_id}:{spec}" for run_id, (spec, _) in CASES.items()] + ["override:data+override:1"]
    train(HF_TRAIN, runs_dir, *specs, timeout=600)
    return runs_dir


@pytest.mark.slow
@pytest.mark.parametrize("run_id", list(CASES))
def test_planted_fault_is_named_by_the_replay(runs: Path, run_id: str) -> None:
    code, report, err = replay(runs / run_id)
    assert code == 0, err
    assert verdict(report) == CASES[run_id][1], report
    if run_id == "data":
        assert report["evidence"]["field"] == "batch['inputs_embeds']" and report["evidence"]["samples"] == [1]
    if run_id == "optimizer":
        assert "bert.embeddings.token_type_embeddings.weight" in report["parameters"]
    if "bf16" in run_id:
        assert report["evidence"]["precision"]["autocast_dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_alert_step_is_the_first_nan_although_the_trainer_logs_a_finite_loss(runs: Path) -> None:
    run = runs / "data"
    assert first_nonfinite_step(run) == STEP
    # logging_nan_inf_filter: the Trainer's own log shows a finite loss at that step.
    logged = [e for e in json.loads((runs / "data.trainer-log.json").read_text()) if "loss" in e]
    assert len(logged) == FAULT_STEP + 3
    assert all(math.isfinite(float(e["loss"])) for e in logged)
    assert (run / f"capture-rank0-step{STEP:09d}-nonfinite.h5").exists()
    assert [int(e["step"]) for e in logged] == [r["step"] for r in stream(run) if r.get("kind") == "step"]


@pytest.mark.slow
def test_run_json_holds_config_optimizer_and_scheduler(runs: Path) -> None:
    args = json.loads((runs / "loss-accum2-bf16" / "run.json").read_text())["recipe_args"]
    assert args["model_class"]["qualname"] == "BertForSequenceClassification"
    assert args["model_class"]["module"].startswith("transformers.models.bert")
    assert (args["config"]["hidden_size"], args["config"]["num_hidden_layers"]) == (16, 2)
    assert args["optimizer"]["class"]["qualname"] == "AdamW"
    names = [n for g in args["optimizer"]["groups"] for n in g["params"]]
    # Every parameter of the 2-layer BERT (16 per layer, 5 embeddings, 2 pooler, 2 classifier),
    # by name, in the Trainer's two groups (with / without weight decay).
    assert len(set(names)) == len(names) == 41 and len(args["optimizer"]["groups"]) == 2
    assert "classifier.weight" in names and "" not in names
    assert args["scheduler"]["name"] == "linear" and args["scheduler"]["num_warmup_steps"] == 2
    assert (args["accumulation_steps"], args["max_grad_norm"], args["bf16"]) == (2, 1.0, True)
    # BERT takes **kwargs: the Trainer passes num_items_in_batch and does not divide by 2.
    assert args["loss_normalized"] is True
    steps = [r for r in stream(runs / "loss-accum2-bf16") if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(1, FAULT_STEP + 4))


@pytest.mark.slow
def test_a_model_class_of_the_script_is_recorded_with_its_path_and_the_divided_loss(runs: Path) -> None:
    args = json.loads((runs / "backward-accum2-script" / "run.json").read_text())["recipe_args"]
    assert args["model_class"] == {"module": "__main__", "qualname": "TinyModel", "script": str(HF_TRAIN)}
    assert args["config"]["width"] == 16 and args["config"]["model_type"] == "sentineld-tiny"
    # No **kwargs in its forward: the Trainer divides each micro-batch's loss by 2, as train_step does.
    assert args["loss_normalized"] is False and args["accumulation_steps"] == 2


@pytest.mark.slow
def test_a_compute_loss_override_gets_a_clear_message(runs: Path) -> None:
    meta = json.loads((runs / "override" / "run.json").read_text())
    assert meta["recipe_args"]["custom_loss"] == "WeightedTrainer overrides compute_loss"
    code, report, err = replay(runs / "override")
    assert code == 2 and report is None
    assert "WeightedTrainer overrides compute_loss" in err and "Pass loss_fn= or recipe=" in err


def test_unknown_keywords_fail_when_the_callback_is_built() -> None:
    from sentineld.integrations.transformers import SentineldCallback

    with pytest.raises(ValueError, match=r"\['scaler'\] come from the trainer"):
        SentineldCallback(scaler=None)


@pytest.mark.slow
def test_an_uncaught_exception_in_train_writes_the_crash_capture(tmp_path: Path) -> None:
    """The Trainer has no exception event for callbacks: the agent's excepthook writes it."""
    import subprocess
    import sys

    from tests.conftest import REPO

    from .helpers import ENV

    out = subprocess.run([sys.executable, str(HF_TRAIN), str(tmp_path), "hc:crash"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "planted crash loading sample 12" in out.stderr
    recs = stream(tmp_path / "hc")
    last = max(r["step"] for r in recs if r.get("kind") == "step")
    assert [p.name for p in (tmp_path / "hc").glob("capture-*.h5")] == [f"capture-rank0-step{last:09d}-crash.h5"]
    assert recs[-1]["kind"] == "end" and recs[-1]["reason"] == "crashed"
