"""A Lightning training script changed only by adding SentineldCallback, with a planted fault.

The LightningModule lives here, in the script (``__main__``), with the Trainer behind
``if __name__ == "__main__":`` as in Lightning's examples: the replay must find the class
without running the training.

    python lit_train.py RUNS_DIR SPEC [SPEC...]      SPEC = RUN_ID:FAULT[:ACCUMULATE[:PRECISION]]

Several specs train one after another in one process (one Lightning import for all). RUN_ID
``-`` leaves the run id to the callback; ``LIT_DEVICES=2`` trains with DDP on two CPU processes.

FAULT (at optimizer step ``FAULT_STEP``): none | data (NaN in the batch) | forward (a constant
row: 0/0 in the ``norm`` submodule) | loss (a weighted mean with all weights 0 in training_step) |
backward (sqrt'(0) = inf inside ``root``) | optimizer (an infinite LR factor from the scheduler)
| crash (training_step raises).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

# Either import name of Lightning (the standalone ``pytorch_lightning`` package, or ``lightning``).
pl = importlib.import_module(os.environ.get("LIT_PACKAGE", "lightning.pytorch"))

FAULT_STEP = 5
BATCH = 8


class Standardize(nn.Module):
    """(x - mean) / std over features, without an epsilon: 0/0 for a constant row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)


class Root(nn.Module):
    """sqrt(|x * scale|): finite everywhere, its derivative infinite at exactly zero."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * self.scale).abs())


class TinyClassifier(pl.LightningModule):
    def __init__(self, width: int = 8, classes: int = 3, lr: float = 0.05, fault: str = "none",
                 fault_step: int = FAULT_STEP) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.norm = Standardize()
        self.root = Root(width)
        self.fc1 = nn.Linear(width, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, classes)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, w = batch
        logits = self.head(self.drop(torch.relu(self.fc1(self.root(self.norm(x)) + 0.5))))
        if self.hparams.fault == "crash" and self.global_step == self.hparams.fault_step:
            raise RuntimeError("planted crash in training_step")
        # A weighted mean over the batch: 0/0 when every weight is zero.
        loss = (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # Lightning's own return types
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        n = self.hparams.fault_step
        boom = self.hparams.fault == "optimizer"
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float("inf") if boom and s == n else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_data(fault: str, accumulate: int, steps: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * accumulate * BATCH
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    w = torch.ones(n)
    # The rows of the fault step's last micro-batch.
    lo = (FAULT_STEP * accumulate + accumulate - 1) * BATCH
    if fault == "data":
        x[lo + 3, 2] = float("nan")
    elif fault == "forward":
        x[lo + 2] = 1.0  # a constant row: std 0
    elif fault == "loss":
        w[lo:lo + BATCH] = 0.0  # every sample weighted 0: the weighted mean is 0/0
    elif fault == "backward":
        # mean exactly 0, so the standardized 7th feature is exactly 0: sqrt'(0) = inf
        x[lo + 1] = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.0, 0.0])
    return torch.utils.data.TensorDataset(x, y, w)


def fit(runs_dir: str, run_id: str, fault: str, accumulate: int = 1, precision: str = "32-true") -> None:
    from sentineld.integrations.lightning import SentineldCallback

    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps = FAULT_STEP + 4
    model = TinyClassifier(fault=fault)
    loader = torch.utils.data.DataLoader(make_data(fault, accumulate, steps), batch_size=BATCH)
    devices = int(os.environ.get("LIT_DEVICES", "1"))  # 2: DDP (gloo) on two CPU processes
    named = {} if run_id == "-" else {"run_id": run_id}  # "-": the callback's default run id
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, gradient_clip_val=5.0, precision=precision,
        callbacks=[] if os.environ.get("NO_SENTINELD")  # a baseline for the memory figure
        else [SentineldCallback(runs_dir=runs_dir, metrics_port=0, **named)])
    try:
        trainer.fit(model, loader)
    except RuntimeError as exc:
        if fault != "crash":
            raise
        print(f"crashed as planted: {exc}")


def main() -> None:
    runs_dir = sys.argv[1]
    for spec in sys.argv[2:]:
        run_id, fault, *rest = spec.split(":")
        fit(runs_dir, run_id, fault, int(rest[0]) if rest else 1, rest[1] if len(rest) > 1 else "32-true")


if __name__ == "__main__":
    main()
