"""Gradients carried over from a forgotten ``optimizer.zero_grad()``.

The method: a forgotten ``zero_grad()`` makes the gradients pile up step after step, so the agent
checks whether gradients are already present when a step begins, and where it cannot (CUDA), the
grad norm growing linearly with the step is the tell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, make_verdict, step_of, tail, trailing
from .gradients import applied_norms

__all__ = ["ZeroGradConfig", "detect_forgotten_zero_grad"]

ZERO_GRAD_FIX = (
    "Gradients from earlier steps are still there when the next step starts: call "
    "optimizer.zero_grad() (set_to_none=True) once per optimizer step, before backward. If you "
    "accumulate gradients on purpose, declare it to the agent.")


@dataclass(frozen=True)
class ZeroGradConfig:
    """``forgotten_zero_grad``: gradients carried over from earlier steps.

    Fires when (a) the agent saw gradients already present at the start of ``carried_steps``
    consecutive steps (``StepRecord.grads_carried``), or (b) where that was not checked
    (``grads_carried`` None, e.g. on CUDA), the grad norm grew almost linearly with the step over
    the last ``trend_span`` steps (Pearson r >= ``trend_min_r``) by at least ``trend_min_ratio``:
    the signature of a sum of per-step gradients.

    Attributes:
        enabled: run this detector.
        carried_steps: default 2 (one carried step can be a loop that zeroes between forward and
            backward; two in a row is the bug).
        trend_span: default 20 steps.
        trend_min_r: default 0.98.
        trend_min_ratio: last/first grad norm of the span. Default 4.0 (our measurement: healthy
            runs in tests/signatures never grow 4x in 20 steps with r >= 0.98).
    """

    enabled: bool = True
    carried_steps: int = 2
    trend_span: int = 20
    trend_min_r: float = 0.98
    trend_min_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.carried_steps < 1 or self.trend_span < 5:
            raise ValueError("forgotten_zero_grad.carried_steps must be >= 1, trend_span >= 5")


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return 0.0
    return sxy / math.sqrt(sxx * syy)


def detect_forgotten_zero_grad(records: Sequence[StepRecord], config: ZeroGradConfig
                               ) -> list[Verdict]:
    """Report gradients carried over between steps (``grads_carried``, or a linear grad-norm climb).

    Args:
        records: step records, oldest first.
        config: thresholds.

    Returns:
        One critical verdict, or nothing.
    """
    if not config.enabled or not records:
        return []
    run, first = 0, None
    for r in trailing(records):
        if getattr(r, "grads_carried", None) is True:
            run += 1
            first = r
        else:
            break
    if run >= config.carried_steps and first is not None:
        step = step_of(first)
        msg = (f"gradients from the previous step were still present when steps {step}.."
               f"{step_of(records[-1])} began ({run} steps): zero_grad() not called")
        return [make_verdict("forgotten_zero_grad", step, msg, {"carried_steps": run},
                             ZERO_GRAD_FIX)]
    recent = list(tail(records, config.trend_span))
    if len(recent) < config.trend_span:
        return []
    if any(getattr(r, "grads_carried", None) is False for r in recent):
        return []
    pts = applied_norms(recent)
    if len(pts) < config.trend_span * 0.9:
        return []
    xs = [float(s) for s, _ in pts]
    ys = [g for _, g in pts]
    if not ys[0] > 0 or ys[-1] / ys[0] < config.trend_min_ratio:
        return []
    r_ = _pearson(xs, ys)
    if r_ < config.trend_min_r:
        return []
    step = pts[0][0]
    msg = (f"grad norm grew linearly with the step from step {step} ({ys[0]:.3g} -> {ys[-1]:.3g}, "
           f"r={r_:.3f}): gradients accumulate across steps, zero_grad() not called?")
    return [make_verdict("forgotten_zero_grad", step, msg,
                         {"grad_norm_start": ys[0], "grad_norm_last": ys[-1], "pearson_r": r_},
                         ZERO_GRAD_FIX)]
