"""Tiny models for the framework tests that run in the test process (importable classes, so
run.json names a module, not a script)."""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn
from torch.nn import functional as F

pl = importlib.import_module(os.environ.get("LIT_PACKAGE", "lightning.pytorch"))

WIDTH, CLASSES, BATCH = 6, 3, 4


def data(n: int, scale: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples ``(x [n, WIDTH] * scale, y [n])``; a large ``scale`` makes a large grad norm."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g) * scale, torch.randint(0, CLASSES, (n,), generator=g)


class LitNet(pl.LightningModule):
    """Linear -> tanh -> Linear; ``anneal``: the loss is weighted by ``1 / (1 + global_step)``,
    and by ``1 + current_epoch`` (a module whose step depends on the trainer's state)."""

    def __init__(self, lr: float = 0.1, anneal: bool = False, nan_at: int = -1, gain: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc = nn.Linear(WIDTH, 8)
        self.head = nn.Linear(8, CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.fc(x))
        if self.global_step == self.hparams.nan_at:
            h = h * float("inf") * 0.0  # planted: inf * 0 = nan, in training_step (outside a module)
        loss = F.cross_entropy(self.head(h), y) * self.hparams.gain
        if self.hparams.anneal:
            loss = loss * (1.0 + self.current_epoch) / (1.0 + self.global_step)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return types
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
