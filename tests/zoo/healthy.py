"""Fault zoo, healthy: models, recipes and batches (the table is in :mod:`.cases`)."""

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
from .common import MLP, _ce, _cls_batch, _gen  # noqa: F401
from .faults_forward import ProjNormNet, SampleNorm  # noqa: F401


def make_healthy_adam(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = MLP()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), loss_fn=_ce,
                  num_classes=4)


class NoisyDropoutMLP(nn.Module):
    """Gaussian noise injection and dropout: every step draws from the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop1 = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, 64)
        self.drop2 = nn.Dropout(0.3)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.1 * torch.randn_like(x)
        h = self.drop1(F.gelu(self.fc1(x)))
        return self.head(self.drop2(F.gelu(self.fc2(h))))


def make_healthy_dropout_noise(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = NoisyDropoutMLP()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                  loss_fn=_ce)


def make_healthy_accum_clip(seed: int = 0) -> Recipe:
    """Gradient accumulation (4 micro-batches), clipping, AdamW and a cosine schedule with dropout."""
    torch.manual_seed(seed)
    model = NoisyDropoutMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    return Recipe(model=model, optimizer=opt, loss_fn=_ce, scheduler=sched, clip_grad_norm=0.5,
                  accumulation_steps=4)


def _accum_batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_cls_batch(21, 4 * step + i, b=8) for i in range(4)]


def make_healthy_amp(seed: int = 0) -> Recipe:
    """autocast(float16) + GradScaler + clipping on CPU."""
    torch.manual_seed(seed)
    model = ProjNormNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                  loss_fn=_ce, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10),
                  autocast_dtype=torch.float16, clip_grad_norm=1.0)


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 16, num_layers=2, batch_first=True, dropout=0.3)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def make_healthy_gru(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = GRUClassifier()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    return Recipe(model=model, optimizer=opt, loss_fn=_ce,
                  scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))


def _gru_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(23, step)
    return torch.randn(8, 10, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def make_healthy_bf16(seed: int = 0) -> Recipe:
    """Built in float32; the training script casts the model to bfloat16 (see ``_to_bf16``)."""
    torch.manual_seed(seed)
    model = MLP()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_bf16_ce)


def _bf16_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)


def _to_bf16(recipe: Recipe) -> None:
    recipe.model.to(torch.bfloat16)


# =============================================================================== 10M parameters
class WideMLP(nn.Module):
    """~10.0M parameters: 768 -> 2048 -> 2048 -> 2048 -> 10, with a custom standardization first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = SampleNorm()
        self.fc1 = nn.Linear(768, 2048)
        self.fc2 = nn.Linear(2048, 2048)
        self.fc3 = nn.Linear(2048, 2048)
        self.head = nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(self.norm(x)))
        return self.head(F.relu(self.fc3(F.relu(self.fc2(h)))))


def make_big_zero_std(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = WideMLP()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), loss_fn=_ce)


def _big_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(30, step, b=32, d=768, c=10)
    if step == 8:
        x[17] = 1.0
    return x, y


# =============================================================================== the table
