"""Fault zoo, faults forward: models, recipes and batches (the table is in :mod:`.cases`)."""

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


def make_lr_too_high(seed: int = 0) -> Recipe:
    """MLP + SGD(momentum 0.9) at lr 50: weights grow each step until a Linear's output overflows."""
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=50.0, momentum=0.9)
    return Recipe(model=model, optimizer=opt, loss_fn=_ce, num_classes=4)


def _loud_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(1, step)
    return 4.0 * x, y


# ------------------------------------------------------------------- 2. log(0) in a hand-written loss
class RateNet(nn.Module):
    """Poisson rate regression: (B, 8) -> (B,) rates >= 0 (ReLU output, can be exactly 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 1)
        self.rate = nn.ReLU()
        with torch.no_grad():
            self.out.bias.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rate(self.out(self.act(self.fc(x)))).squeeze(-1)


def poisson_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    """Hand-written Poisson NLL ``rate - y log(rate)``: log(0) where a rate is exactly 0."""
    x, y = batch
    rate = model(x)
    return (rate - y * torch.log(rate)).mean()


def make_log_zero_loss(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = RateNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), loss_fn=poisson_nll)


def _poisson_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2, step)
    x = torch.randn(16, 8, generator=g)
    y = torch.poisson(torch.full((16,), 0.3), generator=g)
    y[0] = 1.0  # at least one positive count per batch
    return x, y


# ---------------------------------------------------- 3. sigmoid saturating to exactly 0 before a log
class LogProb(nn.Module):
    """(B,) logits -> (B, 2) log-probabilities as ``log(sigmoid(+-z))``: -inf once |z| > ~104."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.log(torch.sigmoid(-z)), torch.log(torch.sigmoid(z))], dim=-1)


class BinaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.logprob = LogProb()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logprob(self.fc(x).squeeze(-1))


def _binary_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return -(model(x) * F.one_hot(y, 2)).sum(-1).mean()


def make_sigmoid_log(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = BinaryNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=_binary_nll)


def _separable_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3, step)
    y = torch.randint(0, 2, (16,), generator=g)
    x = torch.randn(16, 8, generator=g) + 2.0 * (2 * y[:, None] - 1)
    return x * (1.0 + step) ** 2, y  # unnormalized count features that grow over time


# ------------------------------------------------- 4. division by a zero std in a custom normalization
class SampleNorm(nn.Module):
    """Per-sample standardization ``(x - mean) / std`` over features, no eps: 0/0 on a constant row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = SampleNorm()
        self.fc = nn.Linear(16, 16)
        self.act = nn.ReLU()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(self.norm(x))))


def make_zero_std(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = NormNet()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=_ce)


def _stuck_sensor_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(4, step)
    if step == 7:
        x[5] = 0.25  # a stuck sensor: every feature of sample 5 reads the same value
    return x, y


# ----------------------------------------------------------- 5. unbiased variance of a single element
class BatchStandardize(nn.Module):
    """Hand-written batch norm over dim 0 with the *unbiased* variance: NaN for a batch of one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / torch.sqrt(x.var(0) + 1e-5)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = BatchStandardize()
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.bn(self.fc(x))))


def make_var_single(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = BNNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_ce)


def _epoch_tail_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # 97 samples in batches of 16: the seventh batch of the epoch holds a single sample.
    x, y = _cls_batch(5, step)
    return (x[:1], y[:1]) if step % 7 == 6 else (x, y)


# ------------------------------------------------------ 6. softmax over a row where every key is masked
class MaskedAttention(nn.Module):
    """Single-head self-attention with a key padding mask filled with -inf: (B, T, D) -> (B, T, D)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.d = d

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.d)                 # (B, T, T)
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = MaskedAttention(d)
        self.head = nn.Linear(d, 4)

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(tokens), keep).mean(1))


def _seq_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, keep, y = batch
    return F.cross_entropy(model(tokens, keep), y)


def make_masked_softmax(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = TinyEncoder()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=_seq_ce)


def _padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(6, step)
    tokens = torch.randint(1, 32, (8, 6), generator=g)
    lengths = torch.randint(1, 7, (8,), generator=g)
    if step == 6:
        lengths[2] = 0  # an empty sequence: every key position masked
    keep = torch.arange(6)[None, :] < lengths[:, None]
    tokens = tokens.masked_fill(~keep, 0)
    return tokens, keep, torch.randint(0, 4, (8,), generator=g)


# ------------------------------------------- 7. float16 overflow of an activation, followed by a norm
class ProjNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.norm(self.proj(x))))


def make_fp16_overflow(seed: int = 0) -> Recipe:
    """autocast(float16) + GradScaler on CPU; raw (unnormalized) inputs."""
    torch.manual_seed(seed)
    model = ProjNormNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=_ce,
                  scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), autocast_dtype=torch.float16)


def _raw_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(7, step)
    x = x * 300.0
    if step == 8:
        x[4] = 60000.0  # a saturated sensor: fine in float16 (< 65504), proj's output is not
    return x, y


# ------------------------------------------------------------------------ 8. NaN in the input data
def make_nan_input(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = MLP()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), loss_fn=_ce)


def _nan_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(8, step)
    if step == 6:
        x[3, 2] = float("nan")
        x[11, 0] = float("nan")
    return x, y


# -------------------------------------------- 9. gradient of sqrt at exactly zero (finite forward)
class L2Normalize(nn.Module):
    """``x / (||x|| + eps)`` with ``||x|| = sqrt(sum x^2)``: finite at x = 0, its gradient is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)


class CosineNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 8, bias=False)
        self.normalize = L2Normalize()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.normalize(self.embed(x)))


def make_sqrt_zero_grad(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = CosineNet()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce)


def _blank_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cls_batch(9, step)
    if step == 7:
        x[9] = 0.0  # a blank sample: its embedding is exactly 0
    return x, y


# ------------------------------------ 10. mean cross-entropy over a batch whose labels are all ignored
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


def _tag_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, tags = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, 5), tags.reshape(-1), ignore_index=-100)


def make_ce_all_ignored(seed: int = 0) -> Recipe:
    torch.manual_seed(seed)
    model = Tagger()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=_tag_loss)


def _tag_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(10, step)
    tokens = torch.randint(0, 32, (4, 8), generator=g)
    tags = torch.randint(0, 5, (4, 8), generator=g)
    tags[:, 6:] = -100
    if step == 5:
        tags[:] = -100  # a batch of pure padding: nothing to average over
    return tokens, tags
