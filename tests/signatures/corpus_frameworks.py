"""Healthy framework runs of the corpus (issue 21): Lightning and the Hugging Face Trainer, tiny
models built from configs (nothing is downloaded), each watched by its sentineld callback.

    python corpus_frameworks.py RUNS_DIR [NAME...]      (default: every run)

One process trains them one after another (one import of each framework). Run ids are the names
in :data:`RUNS`; each run's ``num_classes`` goes to the callback as a user would pass it.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

#: name -> num_classes given to the callback
RUNS = {"lightning_mlp": 4, "lightning_clip_1.0": 4, "hf_bert_classifier": 3, "hf_gpt2_lm": 32}


def _lightning(runs_dir: str, name: str, clip: float | None) -> None:
    import lightning.pytorch as pl  # noqa: PLC0415

    from sentineld.integrations.lightning import SentineldCallback  # noqa: PLC0415

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return types
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 4, generator=g)
    x = torch.randn(2048, 16, generator=g)
    y = (x @ w + 0.5 * torch.randn(2048, 4, generator=g)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True,
                                         generator=g)
    trainer = pl.Trainer(max_steps=120, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         gradient_clip_val=clip,
                         callbacks=[SentineldCallback(run_id=name, runs_dir=runs_dir, metrics_port=0,
                                                      localize="off", num_classes=RUNS[name])])
    trainer.fit(Classifier(), loader)


class _Tokens(torch.utils.data.Dataset):
    """Sequences over a 32-symbol vocabulary: labels for a classifier or next-token targets."""

    def __init__(self, n: int, seq: int, lm: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 32, (n, seq), generator=g)
        if lm:  # a learnable pattern: every other token repeats the one before
            self.ids[:, 1::2] = self.ids[:, 0::2]
        self.y = (self.ids[:, 0] % 3) if not lm else None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        out["labels"] = ids.clone() if self.y is None else self.y[i]
        return out


def _hf(runs_dir: str, name: str) -> None:
    from transformers import (  # noqa: PLC0415
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainingArguments,
    )

    from sentineld.integrations.transformers import SentineldCallback  # noqa: PLC0415

    torch.manual_seed(0)
    lm = name == "hf_gpt2_lm"
    if lm:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    else:
        model = BertForSequenceClassification(BertConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, num_labels=3))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=100, per_device_train_batch_size=16, learning_rate=1e-3,
            warmup_steps=10, lr_scheduler_type="cosine", weight_decay=0.01, use_cpu=True, report_to=[],
            save_strategy="no", logging_steps=50, disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens(1600, 16, lm),
                          callbacks=[SentineldCallback(run_id=name, runs_dir=runs_dir, metrics_port=0,
                                                       localize="off", num_classes=RUNS[name])])
        trainer.train()


def main() -> None:
    runs_dir = sys.argv[1]
    torch.set_num_threads(1)
    for name in sys.argv[2:] or list(RUNS):
        if name.startswith("lightning"):
            _lightning(runs_dir, name, 1.0 if "clip" in name else None)
        else:
            _hf(runs_dir, name)


if __name__ == "__main__":
    main()
