"""The loss curve diverging: a jump far above its recent level, or a steady climb.

The method: a loss that diverges means the learning rate is too large or something upstream broke
(a bad batch, a numerics fault). Per-step minibatch losses are noisy and heavy-tailed, so both rules
compare medians (of a few steps, or of chunks of steps) rather than single values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import (
    Verdict,
    chance_loss,
    finite_losses,
    make_verdict,
    median,
    positive_ints,
    robust_sigma,
    tail,
    tail_chunk_medians,
)

__all__ = ["DivergenceSpikeConfig", "DivergenceGrowthConfig", "detect_divergence_spike",
           "detect_divergence_growth"]

DIVERGENCE_FIX = (
    "Learning rate too large is the usual cause: lower it (range test), add warmup, clip "
    "gradients (clip_grad_norm_); if it followed a particular batch, check that batch's data "
    "(replay the step).")


@dataclass(frozen=True)
class DivergenceSpikeConfig:
    """``divergence_spike``: the loss jumped far above its recent level and stayed there.

    Fires when each of the last ``confirm_steps`` finite losses exceeds
    ``m + max(k * sigma, (ratio - 1) * |m|)``, where ``m`` is the median and ``sigma`` the robust
    (MAD) spread of the ``baseline_steps`` losses before them. Requiring every confirming step to be
    high ignores the single hard batch that heavy-tailed minibatch losses produce.

    Attributes:
        enabled: run this detector.
        baseline_steps: steps of history the jump is measured against. Default 50 (our choice:
            long enough for a stable median, short enough to follow a decreasing loss).
        min_baseline_steps: fewer finite baseline losses than this: no verdict. Default 20.
        confirm_steps: consecutive high losses needed. Default 3.
        ratio: the confirming losses must be at least this multiple of the baseline median.
            Default 3.0.
        k: ... and at least this many robust standard deviations above it. Default 15 (our
            measurement: the noisiest healthy run in tests/signatures, SGD lr 0.3 on batches of
            8, reaches 58% of this bar; 85% with k=10).
        min_level: ... and at least this share of ln(num_classes) when known (relative jumps
            among near-zero losses of a converged run are noise). Default 0.05.
        min_loss: the same floor, absolute, without num_classes. Default 0.1 (assumes a
            cross-entropy-like scale: set it for other losses).
    """

    enabled: bool = True
    baseline_steps: int = 50
    min_baseline_steps: int = 20
    confirm_steps: int = 3
    ratio: float = 3.0
    k: float = 15.0
    min_level: float = 0.05
    min_loss: float = 0.1

    def __post_init__(self) -> None:
        positive_ints(self, "divergence_spike", "baseline_steps", "min_baseline_steps",
                       "confirm_steps")
        if not self.ratio > 1 or not self.k >= 0:
            raise ValueError("divergence_spike.ratio must be > 1 and k >= 0")


@dataclass(frozen=True)
class DivergenceGrowthConfig:
    """``divergence_growth``: the loss climbs steadily (no single jump).

    The last ``span`` finite losses are cut into chunks of ``chunk``; fires when the chunk
    medians rose in at least ``min_rising`` of their successive differences and the last chunk
    median is at least ``ratio`` times the lowest one.

    Attributes:
        enabled: run this detector.
        span: steps looked at. Default 60.
        chunk: steps per chunk (medians smooth minibatch noise). Default 10.
        min_rising: share of successive chunk-median differences that must be rises. Default 0.8
            (4 of 5).
        ratio: last chunk median over the lowest one. Default 4.0 (our measurement: converged
            healthy runs in tests/signatures drift up to 2.5x over 60 steps at losses ~0.01-0.1).
        min_level: with num_classes known, the last chunk median must also reach this share of
            ln(C) (a climb among near-zero losses is noise, not divergence). Default 0.3 (our
            measurement: the noisy SGD run in tests/signatures, healthy, climbs 30x from 0.01 to
            0.35 = 0.15 ln(10) between its calm and rough stretches).
        min_loss: without num_classes, the absolute level it must reach instead. Default 0.5
            (same measurement; assumes a cross-entropy-like scale: set it for other losses).
    """

    enabled: bool = True
    span: int = 60
    chunk: int = 10
    min_rising: float = 0.8
    ratio: float = 4.0
    min_level: float = 0.3
    min_loss: float = 0.5

    def __post_init__(self) -> None:
        positive_ints(self, "divergence_growth", "span", "chunk")
        if self.span < 3 * self.chunk:
            raise ValueError("divergence_growth.span must be >= 3 * chunk")
        if not 0 < self.min_rising <= 1 or not self.ratio > 1:
            raise ValueError("divergence_growth.min_rising must be in (0, 1] and ratio > 1")


def detect_divergence_spike(records: Sequence[StepRecord], config: DivergenceSpikeConfig,
                            num_classes: int | None = None) -> list[Verdict]:
    """Report a loss that jumped far above its recent median and stayed there.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss, or None.

    Returns:
        One critical verdict at the first confirming step, or nothing.
    """
    if not config.enabled:
        return []
    need = config.confirm_steps + config.min_baseline_steps
    # finite losses of the tail only: the detector runs on every record, keep it O(baseline)
    pts = finite_losses(tail(records, config.confirm_steps + config.baseline_steps))
    if len(pts) < need:
        return []
    recent = pts[-config.confirm_steps:]
    base = [v for _, v in pts[:-config.confirm_steps]]
    m = median(base)
    sigma = robust_sigma(base, m)
    ref = chance_loss(num_classes)
    floor = config.min_level * ref if ref is not None else config.min_loss
    bar = max(m + max(config.k * sigma, (config.ratio - 1.0) * abs(m)), floor)
    low = min(v for _, v in recent)
    if not low > bar:
        return []
    step = recent[0][0]
    msg = (f"loss jumped to {low:.4g}+ for {config.confirm_steps} steps from step {step} "
           f"(median of the {len(base)} steps before: {m:.4g}; bar {bar:.4g})")
    return [make_verdict("divergence_spike", step, msg,
                         {"loss": recent[-1][1], "min_recent_loss": low, "baseline_median": m,
                          "baseline_sigma": sigma, "threshold": bar}, DIVERGENCE_FIX)]


def detect_divergence_growth(records: Sequence[StepRecord], config: DivergenceGrowthConfig,
                             num_classes: int | None = None) -> list[Verdict]:
    """Report a loss that climbs steadily over the last ``span`` steps.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss, or None.

    Returns:
        One critical verdict at the last step, or nothing.
    """
    if not config.enabled:
        return []
    got = tail_chunk_medians(records, config.span, config.chunk, 3)
    if got is None:
        return []
    pts, meds = got
    diffs = [b - a for a, b in zip(meds, meds[1:])]
    rising = sum(d > 0 for d in diffs) / len(diffs)
    lowest = min(meds)
    if rising < config.min_rising or not lowest > 0 or meds[-1] < config.ratio * lowest:
        return []
    ref = chance_loss(num_classes)
    if meds[-1] < (config.min_level * ref if ref is not None else config.min_loss):
        return []
    step = pts[-1][0]
    msg = (f"loss climbing for {len(pts)} steps: chunk medians {lowest:.4g} -> {meds[-1]:.4g} "
           f"({meds[-1] / lowest:.1f}x), rising in {rising:.0%} of chunks, at step {step}")
    return [make_verdict("divergence_growth", step, msg,
                         {"loss_median_start": meds[0], "loss_median_min": lowest,
                          "loss_median_last": meds[-1], "rising_fraction": rising},
                         DIVERGENCE_FIX)]
