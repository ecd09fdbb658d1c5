"""The fault zoo: small, real training runs, each with one planted fault and the verdict replay owes.

Every case is a recipe factory (a module-level function, so the replay imports it as
``tests.zoo.cases:make_<name>`` from the repository root, the run's working directory), a
deterministic batch source (``batch(step)``; data never draws from the global RNG, so dropout and
in-model noise are the only random draws of a step) and an :class:`Expect`. ``tests/zoo/run.py``
trains each case with the real agent attached; ``tests/replay/test_zoo.py`` replays them.

Faulty cases name the phase, module, aten op, parameters and cause class replay must report;
healthy cases are replayed at a finite step (``replay_step``) and must answer ``none`` (cause class
``finite``), reproduced bit for bit.
"""

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

__all__ = ["Expect", "Case", "CASES", "ZOO", "BENCH_ONLY"]


@dataclass(frozen=True)
class Expect:
    """What replay must report for a case.

    Attributes:
        phase: ``data`` | ``forward`` | ``backward`` | ``optimizer`` | ``none``.
        module: qualified module name from ``named_modules()``; None outside the model (a loss
            computed in the loss function, the scheduler) or when not applicable.
        op: aten op (overload dropped; in backward the forward op whose derivative went
            non-finite, or a custom autograd Function's class name), or ``lr`` for the scheduler;
            None when not applicable.
        cause: the cause class (``sentineld.contracts.verdict.CAUSE_CLASSES``).
        parameters: parameter names that must be among the reported ones.
        field: for ``data``, the batch field; samples: the sample indices holding NaN/Inf.
        state_entry: for an optimizer-state fault, the state entry named (e.g. ``exp_avg_sq``).
        node: for ``backward``, the autograd node whose backward made the value.
        step: the offending step, when the case pins it.
        where: the verdict's ``where``, when the case pins it (outside the model).
    """

    phase: str
    module: str | None = None
    op: str | None = None
    cause: str = "finite"
    parameters: tuple[str, ...] = ()
    field: str | None = None
    samples: tuple[int, ...] = ()
    state_entry: str | None = None
    node: str | None = None
    step: int | None = None
    where: str | None = None


@dataclass(frozen=True)
class Case:
    """One zoo run.

    Attributes:
        name: run id, and ``make_<name>`` is its recipe factory.
        batch: ``step -> batch`` (deterministic, independent of the global RNG).
        steps: most steps to train (training stops 3 steps after the first non-finite value).
        expect: the verdict replay owes.
        recipe_args: keyword arguments of the factory (stored in run.json).
        replay_step: the ``--step`` to replay (healthy cases); None = the capture's own step.
        snapshot_every: agent snapshot cadence, steps.
        manual_loop: train with a hand-written loop instead of ``train_step`` (same sequence).
        prepare: applied to the recipe by the training script after the factory (e.g. a cast).
        what: one line for the zoo table.
    """

    name: str
    batch: Callable[[int], Any]
    steps: int
    expect: Expect
    recipe_args: dict[str, Any] = field(default_factory=dict)
    replay_step: int | None = None
    snapshot_every: int = 5
    manual_loop: bool = False
    prepare: Callable[[Recipe], None] | None = None
    what: str = ""

    @property
    def factory(self) -> Callable[..., Recipe]:
        return globals()[f"make_{self.name}"]

    @property
    def recipe(self) -> str:
        return f"tests.zoo.cases:make_{self.name}"


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
_P = "parameters"
ZOO: list[Case] = [
    Case("lr_too_high", _loud_batch, 30, Expect("forward", "head", "aten.addmm", "lr_too_high", step=5),
         snapshot_every=3, what="SGD lr 50, momentum 0.9"),
    Case("log_zero_loss", _poisson_batch, 40, Expect("forward", None, "aten.log", "log_zero", where=OUTSIDE_MODEL),
         what="hand-written Poisson NLL, ReLU rate hits 0"),
    Case("sigmoid_log", _separable_batch, 30, Expect("forward", "logprob", "aten.log", "log_zero"),
         what="log(sigmoid(z)) with |z| > 104"),
    Case("zero_std", _stuck_sensor_batch, 12, Expect("forward", "norm", "aten.div", "div_zero", step=7),
         what="per-sample (x - mean) / std, constant row"),
    Case("var_single", _epoch_tail_batch, 12, Expect("forward", "bn", "aten.var", "var_one_element", step=6),
         what="unbiased var over a batch of one"),
    Case("masked_softmax", _padded_batch, 12, Expect("forward", "attn", "aten._softmax", "softmax_all_masked", step=6),
         what="attention over an empty (all-padding) sequence"),
    Case("fp16_overflow", _raw_batch, 12, Expect("forward", "proj", "aten.addmm", "fp16_overflow", step=8),
         what="autocast fp16 Linear > 65504, then LayerNorm"),
    Case("nan_input", _nan_batch, 12, Expect("data", cause="data_nonfinite", field="batch[0]", samples=(3, 11), step=6),
         what="NaN in two samples of the input"),
    Case("sqrt_zero_grad", _blank_batch, 12,
         Expect("backward", "normalize", "aten.sqrt", "grad_at_singularity", ("embed.weight",), node="SqrtBackward0",
                step=7),
         what="x / sqrt(sum x^2) at x = 0: finite forward, NaN grad"),
    Case("ce_all_ignored", _tag_batch, 12, Expect("forward", None, "aten.nll_loss_forward", "mean_empty", step=5,
                              where=OUTSIDE_MODEL),
         snapshot_every=4,
         what="mean CE with every label == ignore_index"),
    Case("adam_eps_fp16", _bag_batch, 8,
         Expect("optimizer", "emb", "aten.addcdiv_", "optimizer_eps_lost", ("emb.weight",), state_entry="exp_avg_sq",
                step=0),
         what="float16 Adam, eps=1e-8 rounds to 0"),
    Case("warmup_zero", lambda s: _cls_batch(12, s), 12,
         Expect("optimizer", None, "lr", "lr_schedule", step=3, where="learning-rate scheduler (LambdaLR)"), what="LambdaLR warmup over 0 steps"),
    Case("clip_inf_grad", _gain_batch, 40,
         Expect("optimizer", "scale", "aten._foreach_mul_", "clip_of_inf", ("scale.gain",)), snapshot_every=4,
         what="clip_grad_norm_ of an Inf grad (sqrt'(0))"),
    Case("no_zero_grad", _big_regression_batch, 40,
         Expect("backward", "fc", "aten.add_", "grad_accumulated", ("fc.weight",), node="AccumulateGrad"), snapshot_every=64,
         manual_loop=True,
         what="float16 grads summed over steps, no zero_grad"),
    Case("rnn_explode", _left_padded_batch, 20, Expect("backward", "rnn", "aten.mm", "grad_explosion"),
         what="tanh RNN, W_hh radius 2, long left padding"),
    Case("noise_log", _intensity_batch, 60, Expect("forward", "noisylog", "aten.log", "domain_error"),
         what="log(x + noise): the noise sample decides the step"),
    Case("dropout_pool", _pool_batch, 60, Expect("forward", "pool", "aten.div", "div_zero"),
         what="dropout drops a whole row, then mean over kept"),
    Case("accum_nan", _accum_nan_batch, 12, Expect("data", cause="data_nonfinite", field="batch[1][0]", samples=(5,), step=6),
         what="Inf in micro-batch 2 of 3 (accumulation)"),
    Case("custom_backward", _outlier_batch, 12,
         Expect("backward", "act", "StableSoftplus", "custom_backward", ("fc.weight",),
                node="StableSoftplusBackward", step=6),
         what="custom Function, backward exp(x)/(1+exp(x)) overflows"),
    Case("pow_base_zero", _blank_row_batch, 12,
         Expect("backward", "compress", "aten.pow", "grad_at_singularity", ("embed.weight",),
                node="PowBackward1", step=6),
         what="|h| ** alpha (learnable) at h = 0: finite forward, NaN grad"),
    Case("where_branch", _trajectory_batch, 12,
         Expect("backward", "speed", "aten.sqrt", "where_masked_branch", ("embed.weight",),
                node="SqrtBackward0", step=5),
         what="where(d2 > 0, sqrt(d2), 0): 0/0 in the unselected branch"),
    # ---- healthy: replayed at a finite step, must answer none and reproduce bit for bit
    Case("healthy_adam", lambda s: _cls_batch(20, s), 12, Expect("none"), replay_step=8, snapshot_every=64,
         what="Adam MLP"),
    Case("healthy_dropout_noise", lambda s: _cls_batch(22, s), 12, Expect("none"), replay_step=9, snapshot_every=64,
         what="dropout + noise injection, SGD momentum"),
    Case("healthy_accum_clip", _accum_batch, 12, Expect("none"), replay_step=8, snapshot_every=64,
         what="4 micro-batches, clip, AdamW, cosine LR"),
    Case("healthy_amp", lambda s: _cls_batch(24, s), 12, Expect("none"), replay_step=7, snapshot_every=64,
         what="autocast fp16 + GradScaler + clip"),
    Case("healthy_gru", _gru_batch, 12, Expect("none"), replay_step=8, snapshot_every=64,
         what="2-layer GRU with dropout, RMSprop, StepLR"),
    Case("healthy_bf16", lambda s: _cls_batch(25, s), 12, Expect("none"), replay_step=6, snapshot_every=64,
         prepare=_to_bf16, what="model cast to bfloat16 by the script"),
]

#: Not in the test suite (a ~10M-parameter model): ``bench/replay_time.py`` runs it.
BENCH_ONLY: list[Case] = [
    Case("big_zero_std", _big_batch, 12, Expect("forward", "norm", "aten.div", "div_zero", step=8),
         snapshot_every=5, what="10.0M-param MLP + Adam, constant row"),
]

CASES: dict[str, Case] = {c.name: c for c in ZOO + BENCH_ONLY}
