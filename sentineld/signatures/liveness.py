"""Liveness: a run that stopped producing steps (hung collective, dead data loader, deadlock).

Judged by the caller's clock: ``now_s`` minus the last record's ``time_s`` (both Unix seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, finite, make_verdict, median, step_of, tail

__all__ = ["StalledConfig", "detect_stalled"]

STALLED_FIX = (
    "No step recorded for a long time: look at the process (py-spy dump --pid PID), a hung "
    "collective (NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL), a stuck data loader worker, "
    "or a full disk.")


@dataclass(frozen=True)
class StalledConfig:
    """``stalled``: no new step for too long.

    Fires when ``now_s - last.time_s`` exceeds ``threshold_s``, or, when ``step_multiple`` is set,
    exceeds ``max(min_threshold_s, step_multiple * median step_s)`` of the window.

    Attributes:
        enabled: run this detector.
        threshold_s: seconds. Default 1800 (SageMaker Debugger ``StalledTrainingRule`` threshold).
        step_multiple: adaptive bar as a multiple of the median step time, or None (default: off,
            because evaluation and checkpoint pauses make it noisy).
        min_threshold_s: floor of the adaptive bar in seconds. Default 60.
    """

    enabled: bool = True
    threshold_s: float = 1800.0
    step_multiple: float | None = None
    min_threshold_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.threshold_s > 0 or not self.min_threshold_s > 0:
            raise ValueError("stalled.threshold_s and min_threshold_s must be > 0 seconds")
        if self.step_multiple is not None and not self.step_multiple > 0:
            raise ValueError("stalled.step_multiple must be > 0 or None")


def detect_stalled(records: Sequence[StepRecord], config: StalledConfig,
                   now_s: float | None = None) -> list[Verdict]:
    """Report a run whose last step is older than the threshold.

    Args:
        records: step records, oldest first.
        config: thresholds.
        now_s: the caller's Unix time in seconds; None: no verdict.

    Returns:
        One critical verdict at the last recorded step, or nothing.
    """
    now = finite(now_s)
    if not config.enabled or now is None or not records:
        return []
    last = records[-1]
    t = finite(getattr(last, "time_s", None))
    if t is None or not t > 0:
        return []
    gap = now - t
    bar = config.threshold_s
    if config.step_multiple is not None:
        steps = [s for s in (finite(getattr(r, "step_s", None)) for r in tail(records, 50))
                 if s is not None and s > 0]
        if steps:
            bar = min(bar, max(config.min_threshold_s, config.step_multiple * median(steps)))
    if not gap > bar:
        return []
    step = step_of(last)
    msg = f"no step recorded for {gap:.0f} s since step {step} (limit {bar:.0f} s)"
    return [make_verdict("stalled", step, msg, {"seconds_since_last_step": gap, "limit_s": bar},
                         STALLED_FIX)]
