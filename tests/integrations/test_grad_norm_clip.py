"""The grad norm recorded under norm clipping is the norm before clipping, and the stream says
whether clipping applied (issue 21): a real HF Trainer (``max_grad_norm=1.0``, its default) and a
real Lightning Trainer (``gradient_clip_val``), each with inputs scaled so the true norm is far
above the max; the truth is computed by hand from a copy of the model taken before training.
On 49179bb the HF run recorded the clipped norm (1.0) and neither stream had ``clipped``."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from . import clipnets  # noqa: E402


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "stream-rank0.jsonl").read_text().splitlines()
    return [o for o in map(json.loads, filter(None, lines)) if o.get("kind") == "step"]


def _norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def test_hf_trainer_records_the_pre_clip_norm_and_clipped(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from sentineld.integrations.transformers import SentineldCallback

    from .hf_clipnet import TinyConfig, TinyModel, rows

    torch.manual_seed(0)
    model = TinyModel(TinyConfig(gain=100.0))
    before = copy.deepcopy(model)
    ds = rows(3 * clipnets.BATCH)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=clipnets.BATCH,
                             learning_rate=1e-3, max_grad_norm=1.0, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                             train_sampling_strategy="sequential", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SentineldCallback(run_id="hfclip", runs_dir=str(tmp_path), metrics_port=0)])
    trainer.train()
    # By hand: the first batch, the model as it was before the first step.
    batch = {k: torch.stack([ds[i][k] for i in range(clipnets.BATCH)]) for k in ds[0]}
    before(**batch).loss.backward()
    truth = _norm(before)
    assert truth > 10.0  # far above max_grad_norm
    steps = _steps(tmp_path / "hfclip")
    # Steps are the Trainer's global_step once done: the first is 1, as in its logs.
    assert [s["step"] for s in steps] == [1, 2, 3]
    logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [1, 2, 3]
    assert steps[0]["grad_norm"] == pytest.approx(truth, rel=1e-5)
    assert steps[0]["clipped"] is True


def test_lightning_records_the_pre_clip_norm_and_clipped(tmp_path: Path) -> None:
    from sentineld.integrations.lightning import SentineldCallback

    torch.manual_seed(0)
    model = clipnets.LitNet(gain=100.0)
    before = copy.deepcopy(model)
    x, y = clipnets.data(3 * clipnets.BATCH)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=clipnets.BATCH)
    trainer = clipnets.pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5,
                                  callbacks=[SentineldCallback(run_id="litclip", runs_dir=str(tmp_path),
                                                               metrics_port=0)])
    trainer.fit(model, loader)
    F.cross_entropy(before.head(torch.tanh(before.fc(x[:clipnets.BATCH]))), y[:clipnets.BATCH]).mul(100.0).backward()
    truth = _norm(before)
    assert truth > 5.0
    steps = _steps(tmp_path / "litclip")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[0]["grad_norm"] == pytest.approx(truth, rel=1e-5)
    assert steps[0]["clipped"] is True
