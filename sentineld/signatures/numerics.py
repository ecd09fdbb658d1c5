"""Numerical failure: non-finite values, and a GradScaler whose loss scale collapses.

The method (NaN / Inf troubleshooting): when the loss turns nan, find the first bad step and
replay it. ``nonfinite`` names that step. Under mixed precision, GradScaler skipping a step whose
gradients overflowed is normal and must not alarm; a scale that keeps falling means the
gradients overflow whatever the scale, and that is ``loss_scale_collapse``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.nonfinite import INPUT_REASON, current_incident, nonfinite_reasons
from sentineld.contracts.records import StepRecord

from .base import Verdict, finite, make_verdict, step_of, trailing

__all__ = ["NonfiniteConfig", "LossScaleConfig", "detect_nonfinite", "detect_loss_scale_collapse",
           "NONFINITE_FIX", "DATA_NONFINITE_FIX", "LOSS_SCALE_FIX"]

NONFINITE_FIX = (
    "Find the first bad step and replay it (sentineld replay <run> --step N). Likely causes, most "
    "likely first: learning rate too large (lower it); division by zero or log(0) (add eps); "
    "gradient explosion (clip_grad_norm_); fp16 overflow (use GradScaler, check custom ops); "
    "nan in the data (torch.isnan(x).any()); a scheduler dividing by zero.")
DATA_NONFINITE_FIX = (
    "The batch itself holds nan/inf: upstream data cleaning missed them. Check inputs with "
    "torch.isnan(x).any() / torch.isinf(x).any() and fix the data pipeline.")
LOSS_SCALE_FIX = (
    "Gradients overflow in fp16 whatever the scale: find the op that overflows (replay the step), "
    "keep it in fp32 (autocast(enabled=False) around it) or use bfloat16; lower the learning rate; "
    "clip gradients after scaler.unscale_().")


@dataclass(frozen=True)
class NonfiniteConfig:
    """``nonfinite``: a nan/inf loss, gradient, parameter or input anywhere in the window.

    No threshold: any non-finite value is a fault (SageMaker Debugger ``ExplodingTensor``,
    AUTOTRAINER ``nan_loss``/``nan_gradient``/``nan_weight``). A non-finite gradient on a step the
    optimizer skipped (GradScaler found inf) is GradScaler doing its job and is not reported.

    Attributes:
        enabled: run this detector.
    """

    enabled: bool = True


@dataclass(frozen=True)
class LossScaleConfig:
    """``loss_scale_collapse``: GradScaler's scale keeps falling instead of settling.

    GradScaler halves the scale on every overflow and doubles it after ``growth_interval``
    (default 2000) clean steps, so an occasional skipped step is normal, and so is a short burst
    of halvings at the start of training while the scale comes down from 2**16.

    Attributes:
        enabled: run this detector.
        min_scale: fire when the scale is below this. Default 1.0: below 1 the "scaled" gradients
            are smaller than the true ones and still overflow (the issue's rule).
        max_consecutive_skips: fire when this many steps in a row were skipped (each halves the
            scale). Default 10, i.e. the scale fell 1024x with no step applied; our measurement:
            GradScaler's start-up burst (from 2**24) in tests/signatures is 4 in a row.
        max_net_halvings: fire when the scale fell this many halvings below its maximum in the
            window (slow, steady fall with some clean steps between). Default 10 (1024x).
    """

    enabled: bool = True
    min_scale: float = 1.0
    max_consecutive_skips: int = 10
    max_net_halvings: int = 10

    def __post_init__(self) -> None:
        if not self.min_scale > 0:
            raise ValueError(f"loss_scale_collapse.min_scale must be > 0, got {self.min_scale}")
        if self.max_consecutive_skips < 1 or self.max_net_halvings < 1:
            raise ValueError("loss_scale_collapse.max_consecutive_skips and max_net_halvings "
                             "must be >= 1")


def detect_nonfinite(records: Sequence[StepRecord], config: NonfiniteConfig) -> list[Verdict]:
    """Report the first step of the non-finite incident open at the end of the window: a nan/inf
    loss, gradient, learning rate, parameter or input (the rule of
    :mod:`sentineld.contracts.nonfinite`, shared with the agent, which captures that same step).

    An incident followed by ``REARM_STEPS`` finite steps is over (nothing is reported, so the
    daemon sends the recovery notice), and a later non-finite step is a new incident, reported at
    its own first step with ``finite_steps_before`` >= ``REARM_STEPS`` (so the policy alerts it
    even when the previous one was never seen to clear).

    Args:
        records: step records, oldest first.
        config: thresholds.

    Returns:
        One critical verdict at the incident's first step, or nothing.
    """
    if not config.enabled:
        return []
    inc = current_incident(records)
    if inc is None:
        return []
    first = records[inc.first]
    first_reasons = nonfinite_reasons(first) or ["value"]
    data = INPUT_REASON in first_reasons
    step = step_of(first)
    span = len(records) - inc.first
    seen = ("the newest step" if span == 1 else
            f"{inc.nonfinite_steps} of the {span} steps {step}-{step_of(records[-1])} non-finite")
    msg = f"non-finite {', '.join(first_reasons)} at step {step} ({seen})"
    numbers = {"loss": getattr(first, "loss", None), "grad_norm": getattr(first, "grad_norm", None),
               "nonfinite_steps": inc.nonfinite_steps}
    if any(x.startswith("learning rate") for x in first_reasons):
        numbers["lr"] = getattr(first, "lr", None)
    if inc.finite_before:
        numbers["finite_steps_before"] = inc.finite_before
    return [make_verdict("nonfinite", step, msg, numbers,
                         DATA_NONFINITE_FIX if data else NONFINITE_FIX)]


def detect_loss_scale_collapse(records: Sequence[StepRecord], config: LossScaleConfig
                               ) -> list[Verdict]:
    """Report a GradScaler scale that keeps falling (below ``min_scale``, too many skipped steps in
    a row, or too far below its recent maximum).

    Args:
        records: step records, oldest first; records without ``loss_scale`` are ignored.
        config: thresholds.

    Returns:
        One critical verdict, or nothing. Runs without a GradScaler never fire.
    """
    if not config.enabled or not records:
        return []
    last = records[-1]
    scale = finite(getattr(last, "loss_scale", None))
    if scale is None:
        return []
    # consecutive skipped steps at the end of the window
    run, run_start = 0, last
    for r in trailing(records):
        if getattr(r, "optimizer_skipped", False) and finite(getattr(r, "loss_scale", None)) is not None:
            run += 1
            run_start = r
        else:
            break
    peak = max((s for s in (finite(getattr(r, "loss_scale", None)) for r in records) if s is not None),
               default=scale)
    numbers = {"loss_scale": scale, "consecutive_skipped_steps": run, "max_loss_scale": peak}
    if scale < config.min_scale:
        msg = f"GradScaler scale fell to {scale:g} (< {config.min_scale:g}) at step {step_of(last)}"
        return [make_verdict("loss_scale_collapse", step_of(last), msg, numbers, LOSS_SCALE_FIX)]
    if run >= config.max_consecutive_skips:
        msg = (f"{run} optimizer steps in a row skipped for inf/nan gradients since step "
               f"{step_of(run_start)}; GradScaler scale now {scale:g}")
        return [make_verdict("loss_scale_collapse", step_of(run_start), msg, numbers,
                             LOSS_SCALE_FIX)]
    if peak > 0 and peak / scale >= 2.0 ** config.max_net_halvings:
        msg = (f"GradScaler scale fell from {peak:g} to {scale:g} within the window "
               f"(>= {config.max_net_halvings} halvings) at step {step_of(last)}")
        return [make_verdict("loss_scale_collapse", step_of(last), msg, numbers, LOSS_SCALE_FIX)]
    return []
