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
    and by ``1 + current_epoch`` (a module whose step depends on the trainer's state); ``nan_at``:
    a NaN planted in ``training_step`` at that ``global_step``; ``gain``: the loss times it;
    ``peek``: a trainer attribute ``training_step`` reads."""

    def __init__(self, lr: float = 0.1, anneal: bool = False, nan_at: int = -1, gain: float = 1.0,
                 peek: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc = nn.Linear(WIDTH, 8)
        self.head = nn.Linear(8, CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.peek:  # trainer state the replay does not record
            getattr(self.trainer, self.hparams.peek)
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


class Standardize(nn.Module):
    """(x - mean) / std over features, without an epsilon: 0/0 for a constant row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)


class LitGAN(pl.LightningModule):
    """A GAN step under manual optimization: two optimizers (Adam for the discriminator, SGD
    with momentum for the generator), ``manual_backward``, ``opt.step()``, ``opt.zero_grad()``;
    ``training_step`` returns nothing. A constant noise row makes 0/0 in ``gen.0``."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.gen = nn.Sequential(Standardize(), nn.Linear(WIDTH, WIDTH))
        self.disc = nn.Linear(WIDTH, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        z, real = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(z)
        d_loss = F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake.detach())).mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        g_loss = F.softplus(-self.disc(self.gen(z))).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return types
        return [torch.optim.SGD(self.gen.parameters(), lr=self.hparams.lr, momentum=0.9),
                torch.optim.Adam(self.disc.parameters(), lr=self.hparams.lr)]


def gan_data(n: int, constant_row: int | None = None) -> torch.utils.data.TensorDataset:
    z, _ = data(n, seed=1)
    real, _ = data(n, scale=0.5, seed=2)
    if constant_row is not None:
        z[constant_row] = 1.0
    return torch.utils.data.TensorDataset(z, real + 2.0)


def fit(module: pl.LightningModule, dataset: torch.utils.data.Dataset, steps: int, runs_dir: str,
        run_id: str, **trainer_kw: object) -> pl.Trainer:
    """``steps`` optimizer steps of ``module`` with SentineldCallback, batches in order."""
    from sentineld.integrations.lightning import SentineldCallback

    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kw,
                         callbacks=[SentineldCallback(run_id=run_id, runs_dir=runs_dir, metrics_port=0)])
    trainer.fit(module, loader)
    return trainer
