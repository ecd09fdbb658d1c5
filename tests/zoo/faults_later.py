"""Fault zoo, faults later: models, recipes and batches (the table is in :mod:`.cases`)."""

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
from .common import MLP, _ce, _cls_batch, _gen, _mse  # noqa: F401


# --------------------------------------------------------------- 11. Adam whose eps is lost in fp16
class BagNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(64, 16, mode="mean")
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


def _fp16_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, y = batch
    return F.cross_entropy(model(tokens).float(), y)


def make_adam_eps_fp16(seed: int = 0) -> Recipe:
    """A pure float16 model with Adam(eps=1e-8): eps is 0 in float16."""
    torch.manual_seed(seed)
    model = BagNet().half()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8),
                  loss_fn=_fp16_ce)


def _bag_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(11, step)
    return torch.randint(0, 48, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)


# ------------------------------------------------ 12. warmup schedule with zero warmup steps: NaN LR
def make_warmup_zero(seed: int = 0, delay: int = 4, warmup_frac: float = 0.0, total: int = 40) -> Recipe:
    """Hold at 10% for ``delay`` steps, then warm up linearly over ``warmup_frac * total`` steps."""
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    warmup = np.float64(warmup_frac * total)  # 0.0 here: (s - delay) / 0 -> nan at s == delay

    def scale(s: int) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(0.1 + 0.9 * np.clip((s - delay) / warmup, 0.0, 1.0))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, scale)
    return Recipe(model=model, optimizer=opt, loss_fn=_ce, scheduler=sched)


# ---------------------------------------------------------- 13. gradient clipping on an Inf gradient
class SqrtGain(nn.Module):
    """Per-feature gain ``x * sqrt(gain)``, kept >= 0 by projection: sqrt'(0) = Inf."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gain.clamp_(min=0.0)  # projected gradient descent: a gain pushed below 0 sticks at 0
        return x * torch.sqrt(self.gain)


class GainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = SqrtGain(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(x)).squeeze(-1)


def _gated_mse(model: nn.Module, batch: Any) -> torch.Tensor:
    """MSE plus an L1 penalty on the gains (feature selection): unused gains are driven to 0."""
    x, y = batch
    return F.mse_loss(model(x), y) + 0.5 * model.scale.gain.sum()


def make_clip_inf_grad(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = GainNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), loss_fn=_gated_mse,
                  clip_grad_norm=5.0)


def _gain_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(13, step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, 0] - x[:, 1]  # features 2..7 are noise: their gains are driven to 0


# --------------------------------------- 14. forgotten zero_grad: gradients pile up until overflow
def make_no_zero_grad(seed: int = 0) -> Recipe:
    """A float16 scalar regressor ``a x + b`` whose loop never zeroes the gradients."""
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(1, 1))
    model = model.half()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-7), loss_fn=_mse,
                  zero_grad=False)


def _big_regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(14, step)
    x = (torch.rand(16, 1, generator=g) * 8.0).half()
    return x, torch.full((16, 1), 400.0)


# ------------------------------------------------------------- 15. exploding gradients in an RNN
class SeqRegressor(nn.Module):
    """tanh RNN over left-padded sequences: (B, T, 4) -> (B,)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 16, batch_first=True, bias=False)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(16, 16))
            self.rnn.weight_hh_l0.copy_(2.0 * q)  # spectral radius 2: gradients grow 2x per step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)


def make_rnn_explode(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = SeqRegressor()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), loss_fn=_mse)


def _left_padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(15, step)
    pad = 40 + 12 * step  # longer padding every batch (sorted by length, shortest last)
    x = torch.zeros(4, pad + 6, 4)
    x[:, pad:] = torch.randn(4, 6, 4, generator=g) * 0.1
    return x, torch.randn(4, generator=g)


# ----------------------------------------------- 16. noise sampled inside the model, then a log
class NoisyLog(nn.Module):
    """Log-compression of noisy intensities: ``log(x + sigma * N(0, 1))``; NaN when the noise wins."""

    def __init__(self, sigma: float) -> None:
        super().__init__()
        self.sigma = sigma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.sigma * torch.randn_like(x))


class NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noisylog = NoisyLog(0.17)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.noisylog(x))


def make_noise_log(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = NoisyNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_ce)


def _intensity_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(16, step)
    return 0.5 + 0.1 * torch.rand(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


# ------------------------------------- 17. dropout drops a whole row before a mean over kept units
class KeptMean(nn.Module):
    """Dropout, then the mean over the units that survived: 0/0 when none did."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.drop(h)
        return h.sum(-1, keepdim=True) / (h != 0).sum(-1, keepdim=True)


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.pool = KeptMean(0.5)
        self.head = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.sigmoid(self.fc(x))))


def make_dropout_pool(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = PoolNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce)


def _pool_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _cls_batch(17, step, b=4, d=8, c=3)


# -------------------------------------- 18. NaN in one micro-batch of an accumulated step
def make_accum_nan(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = MLP()
    return Recipe(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=_ce,
                  accumulation_steps=3, clip_grad_norm=1.0)


def _accum_nan_batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    micro = [_cls_batch(18, 3 * step + i, b=8) for i in range(3)]
    if step == 6:
        micro[1][0][5, 7] = float("inf")
    return micro


# ------------------- 19. a custom autograd Function whose hand-written backward overflows in exp
class StableSoftplus(torch.autograd.Function):
    """softplus written stably in forward (``max(x, 0) + log1p(exp(-|x|))``) but with a naive
    hand-written backward ``exp(x) / (1 + exp(x))``: inf / inf = NaN once x > ~88.7."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        return g * e / (1 + e)


class Softplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StableSoftplus.apply(x)


class SoftplusNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = Softplus()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


def make_custom_backward(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = SoftplusNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_ce)


def _outlier_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(19, step, d=8, c=3)
    if step == 6:
        x[2] *= 400.0  # an unscaled outlier sample: fc's output passes 88.7, exp(x) overflows
    return x, y


# ------------------------ 20. x ** p with a learnable exponent at base exactly 0 (finite forward)
class PowerCompress(nn.Module):
    """Signed power-law compression ``sign(h) |h| ** alpha`` with a learnable exponent (0.5 at start)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sign(h) * h.abs() ** self.alpha


class CompressNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16, bias=False)
        self.compress = PowerCompress()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.compress(self.embed(x)))


def make_pow_base_zero(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = CompressNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_ce)


def _blank_row_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(20, step)
    if step == 6:
        x[3] = 0.0  # a blank sample: its embedding is exactly 0, |0| ** alpha has an infinite slope
    return x, y


# ------------- 21. sqrt inside torch.where: the branch where() did not select gets 0/0 in backward
class PathSpeed(nn.Module):
    """Distance between consecutive frames, ``where(d2 > 0, sqrt(d2), 0)``: (B, T, D) -> (B, T - 1).

    The where() guards the forward only: a repeated frame (d2 = 0) still sends a zero gradient into
    sqrt's backward, 0 / (2 sqrt(0)) = NaN."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        d2 = ((h[:, 1:] - h[:, :-1]) ** 2).sum(-1)
        return torch.where(d2 > 0, torch.sqrt(d2), torch.zeros_like(d2))


class TrajNet(nn.Module):
    def __init__(self, frames: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.speed = PathSpeed()
        self.head = nn.Linear(frames - 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.speed(self.embed(x)))


def make_where_branch(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = TrajNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_ce)


def _trajectory_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(21, step)
    x = torch.randn(8, 6, 4, generator=g)
    if step == 5:
        x[2, 3] = x[2, 2]  # a paused sensor repeats a frame: zero distance
    return x, torch.randint(0, 3, (8,), generator=g)


# =============================================================================== healthy runs
