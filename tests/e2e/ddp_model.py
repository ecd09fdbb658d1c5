"""A tiny model for the DDP fault tests (imported by the torchrun training script and, as the
run's recipe ``tests.e2e.ddp_model:make_recipe``, by the replay).

``(B, 8) -> (B, 4)`` logits: ``fc1`` (Linear) -> ``bn`` (BatchNorm1d: running stats, which DDP
broadcasts from rank 0) -> ``act`` (Tanh) -> ``drop`` (Dropout: each rank's RNG) -> ``head``,
plus ``norm``: a learned per-feature scale whose row L2 norm feeds ``fc1``'s output. The norm is
``sqrt(sum((x * scale)**2))``; its backward at an all-zero row is 0/0 (the planted backward NaN).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe

__all__ = ["RowNorm", "Net", "make_recipe", "loss_fn", "batch_for", "FAULTS"]

#: Planted faults, each in one rank's batch at one step: NaN data; a row of 3e38 (fc1's addmm
#: overflows); an all-zero row (backward 0/0 in ``norm``); a sample weight of 1e30 (finite loss
#: and gradients, Adam's second moment, the squared gradient, overflows in the optimizer step);
#: ``lossonly``: a sample weight of 0, whose log in the loss's detached term is -inf: that rank's
#: loss is NaN, every gradient (and so every other rank) stays finite.
FAULTS = ("data", "forward", "backward", "optimizer", "lossonly")


class RowNorm(nn.Module):
    """``(B, F) -> (B, 1)``: L2 norm of each row of ``x * scale`` (``scale``: (F,), learned)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).pow(2).sum(dim=1, keepdim=True).sqrt()


class Net(nn.Module):
    """The test model (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = RowNorm(8)
        self.bn = nn.BatchNorm1d(16)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) + 0.1 * self.norm(x)
        return self.head(self.drop(self.act(self.bn(h))))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Sample-weighted mean cross-entropy for ``batch = (x (B, 8), y (B,), weight (B,))``, plus a
    detached ``0 * log(min weight)`` term (0 for weights of 1; NaN once a weight is 0)."""
    x, y, w = batch
    return (F.cross_entropy(model(x), y, reduction="none") * w).mean() + 0.0 * torch.log(w.detach().amin())


def make_recipe(seed: int = 0) -> Recipe:
    """Net + Adam (lr 1e-2), seeded so every rank (and the replay) starts from the same weights."""
    torch.manual_seed(seed)
    model = Net()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                  num_classes=4)


def batch_for(rank: int, step: int, fault: str | None, fault_rank: int, fault_step: int,
              sample: int = 3, size: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``step`` (deterministic), with ``fault`` planted in row ``sample``
    of ``fault_rank``'s batch at ``fault_step``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)
    w = torch.ones(size)
    if fault is not None and rank == fault_rank and step == fault_step:
        if fault == "data":
            x[sample, 5] = float("nan")
        elif fault in ("optimizer", "lossonly"):
            w[sample] = 1e30 if fault == "optimizer" else 0.0
        else:
            x[sample] = 3e38 if fault == "forward" else 0.0
    return x, y, w


def train_one_process(runs_dir: Any, run_id: str, fault: str | None = None, fault_step: int = 2, steps: int = 4,
                      **attach_kw: Any) -> Any:
    """A single-process run of this model watched by the real agent: ``steps`` optimizer steps of
    rank 0's batches, ``fault`` planted at ``fault_step`` (:func:`batch_for`); ``attach_kw`` go to
    ``attach`` (``metrics_port=0, layer_every=0`` unless given). Returns the run dir."""
    from pathlib import Path  # noqa: PLC0415

    from sentineld.agent import attach  # noqa: PLC0415

    rec = make_recipe()
    watch = attach(rec.model, rec.optimizer, run_id=run_id, runs_dir=runs_dir,
                   **{"metrics_port": 0, "layer_every": 0, **attach_kw})
    for step in range(steps):
        batch = batch_for(0, step, fault, 0, fault_step)
        rec.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(rec.model, batch)
        loss.backward()
        rec.optimizer.step()
        watch.step(loss, batch=batch)
    watch.close()
    return Path(runs_dir) / run_id
