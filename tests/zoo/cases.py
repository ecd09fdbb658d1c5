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
from .common import (  # noqa: F401 - recipes are named tests.zoo.cases:make_<case>
    _cls_batch,
)
from .faults_forward import (  # noqa: F401 - recipes are named tests.zoo.cases:make_<case>
    _blank_batch,
    _epoch_tail_batch,
    _loud_batch,
    _nan_batch,
    _padded_batch,
    _poisson_batch,
    _raw_batch,
    _separable_batch,
    _stuck_sensor_batch,
    _tag_batch,
    make_ce_all_ignored,
    make_fp16_overflow,
    make_log_zero_loss,
    make_lr_too_high,
    make_masked_softmax,
    make_nan_input,
    make_sigmoid_log,
    make_sqrt_zero_grad,
    make_var_single,
    make_zero_std,
)
from .faults_later import (  # noqa: F401 - recipes are named tests.zoo.cases:make_<case>
    _accum_nan_batch,
    _bag_batch,
    _big_regression_batch,
    _blank_row_batch,
    _gain_batch,
    _intensity_batch,
    _left_padded_batch,
    _outlier_batch,
    _pool_batch,
    _trajectory_batch,
    make_accum_nan,
    make_adam_eps_fp16,
    make_clip_inf_grad,
    make_custom_backward,
    make_dropout_pool,
    make_no_zero_grad,
    make_noise_log,
    make_pow_base_zero,
    make_rnn_explode,
    make_warmup_zero,
    make_where_branch,
)
from .healthy import (  # noqa: F401 - recipes are named tests.zoo.cases:make_<case>
    _accum_batch,
    _big_batch,
    _gru_batch,
    _to_bf16,
    make_big_zero_std,
    make_healthy_accum_clip,
    make_healthy_adam,
    make_healthy_amp,
    make_healthy_bf16,
    make_healthy_dropout_noise,
    make_healthy_gru,
)

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
         Expect("optimizer", None, "aten.addcdiv_", "optimizer_eps_lost", ("emb.weight",), state_entry="exp_avg_sq",
                step=0, where="optimizer step (Adam)"),
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
