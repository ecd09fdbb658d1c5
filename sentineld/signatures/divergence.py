"""The loss curve diverging: a jump far above its recent level, or a steady climb.

The method: a loss that diverges means the learning rate is too large or something upstream broke
(a bad batch, a numerics fault). Per-step minibatch losses are noisy and heavy-tailed, so both rules
compare medians (of a few steps, or of chunks of steps) rather than single values.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import (
    Verdict,
    chance_loss,
    finite_losses,
    make_verdict,
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
                            num_classes: int | None = None, new: int = 0) -> list[Verdict]:
    """Report a loss that jumped far above its recent median and stayed there.

    The test of one end record: the last ``confirm_steps`` finite losses of the
    ``confirm_steps + baseline_steps`` records ending there, against the finite losses before
    them in those records. It is run for every one of the last ``max(new, 1)`` records as the end
    (issue 21: an episode that began and ended inside one read of a fast run, or of a backlog,
    was never the last three records at an evaluation), and the first end that fires is reported.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss, or None.
        new: records at the end of ``records`` the caller has not evaluated yet (the daemon: read
            since its last evaluation of the rank); 0 tests the last record only.

    Returns:
        One critical verdict at the first confirming step, or nothing.

    Cost: the baseline is a sorted list slid along the ends (bisect in, bisect out) and the MAD is
    computed only for an end whose confirming losses clear ``ratio`` x the median and the floor
    (the bar is never below that), so a healthy stretch costs a few list operations per record.
    """
    if not config.enabled:
        return []
    c, span = config.confirm_steps, config.confirm_steps + config.baseline_steps
    ends = max(int(new), 1)
    recs = tail(records, ends + span - 1)
    # finite losses with the index of their record in ``recs``: the window of the end record e
    # is the records (e - span, e], i.e. the points [lo, hi) with a record index in that range;
    # of those, [hi - c, hi) confirm and [lo, hi - c) are the baseline, kept sorted in ``base``
    pts = _indexed_finite(recs)
    idx = [p[0] for p in pts]
    vals = [p[1][1] for p in pts]
    ref = chance_loss(num_classes)
    floor = config.min_level * ref if ref is not None else config.min_loss
    need, rm1, npts = c + config.min_baseline_steps, config.ratio - 1.0, len(pts)
    base: list[float] = []
    lo = hi = 0
    for e in range(max(0, len(recs) - ends), len(recs)):
        while hi < npts and idx[hi] <= e:
            hi += 1
            if hi - c - 1 >= lo:  # the point leaving the confirming tail joins the baseline
                insort(base, vals[hi - c - 1])
        while lo < hi and idx[lo] <= e - span:
            if lo < hi - c:
                del base[bisect_left(base, vals[lo])]
            lo += 1
        if hi - lo < need:
            continue
        low = min(vals[hi - c:hi])
        if not low > floor:
            continue
        n = len(base)
        m = base[n // 2] if n % 2 else 0.5 * (base[n // 2 - 1] + base[n // 2])
        if not low > m + rm1 * abs(m):
            continue  # under a lower bound of the bar: no need for the MAD
        sigma = robust_sigma(base, m)
        bar = max(m + max(config.k * sigma, rm1 * abs(m)), floor)
        if not low > bar:
            continue
        step = pts[hi - c][1][0]
        msg = (f"loss jumped to {low:.4g}+ for {c} steps from step {step} "
               f"(median of the {n} steps before: {m:.4g}; bar {bar:.4g})")
        return [make_verdict("divergence_spike", step, msg,
                             {"loss": vals[hi - 1], "min_recent_loss": low, "baseline_median": m,
                              "baseline_sigma": sigma, "threshold": bar}, DIVERGENCE_FIX)]
    return []


def _indexed_finite(records: Sequence[StepRecord]) -> list[tuple[int, tuple[int, float]]]:
    """``(index in records, (step, loss))`` of the records whose loss is finite."""
    out = []
    for idx, r in enumerate(records):
        loss, step = getattr(r, "loss", None), getattr(r, "step", None)
        if type(loss) is float and type(step) is int:  # the fast path of well-formed records
            if math.isfinite(loss):
                out.append((idx, (step, loss)))
        else:
            out.extend((idx, p) for p in finite_losses([r]))
    return out


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
