"""Fault zoo, common: models, recipes and batches (the table is in :mod:`.cases`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import OUTSIDE_MODEL


def _gen(case_seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * case_seed + step)


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


class MLP(nn.Module):
    """(B, d_in) -> (B, d_out): fc1 -> ReLU -> fc2 -> ReLU -> head."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def _cls_batch(seed: int, step: int, b: int = 16, d: int = 16, c: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed, step)
    return torch.randn(b, d, generator=g), torch.randint(0, c, (b,), generator=g)


# ----------------------------------------------------------------------------- 1. LR far too high
