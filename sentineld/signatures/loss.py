"""The loss curve: divergence (a jump or a steady climb), plateau, oscillation, initial loss.

The method reads training curves: a loss that diverges means the learning rate is too large or
something upstream broke; a loss that does not decrease means labels, normalisation, output/loss
mismatch, learning rate or gradients not applied (the checklist, in that order); a loss that
oscillates violently without converging means learning rate too large or batch too small; and
the loss at initialisation should be about ln(C) for C classes.

Per-step minibatch losses are noisy and heavy-tailed, so every rule here compares medians (of a
few steps, or of chunks of steps) rather than single values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, chunk_medians, finite, finite_losses, make_verdict, median, robust_sigma, step_of, tail

__all__ = ["DivergenceSpikeConfig", "DivergenceGrowthConfig", "PlateauConfig",
           "OscillationConfig", "InitialLossConfig", "detect_divergence_spike",
           "detect_divergence_growth", "detect_plateau", "detect_oscillation",
           "detect_initial_loss"]

DIVERGENCE_FIX = (
    "Learning rate too large is the usual cause: lower it (range test), add warmup, clip "
    "gradients (clip_grad_norm_); if it followed a particular batch, check that batch's data "
    "(replay the step).")
PLATEAU_FIX = (
    "Loss not decreasing - check in order: wrong labels (print y, visualise); inputs not "
    "normalised (x.min()/x.max()); output layer vs loss mismatch (logits + CrossEntropyLoss, no "
    "double softmax); learning rate (range test); gradients not applied (optimizer.step(), "
    "zero_grad()). First overfit one small batch to ~0 loss.")
OSCILLATION_FIX = (
    "Loss oscillates without converging: learning rate too large or batch too small - lower the "
    "learning rate or raise the batch size; also check that zero_grad() runs every step.")
INITIAL_LOSS_FIX = (
    "Loss at initialisation should be about ln(C) for C classes (2.30 for 10): a large deviation "
    "points at initialisation (e.g. a last layer with large weights) or at the data/labels.")


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
        _positive_ints(self, "divergence_spike", "baseline_steps", "min_baseline_steps",
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
        _positive_ints(self, "divergence_growth", "span", "chunk")
        if self.span < 3 * self.chunk:
            raise ValueError("divergence_growth.span must be >= 3 * chunk")
        if not 0 < self.min_rising <= 1 or not self.ratio > 1:
            raise ValueError("divergence_growth.min_rising must be in (0, 1] and ratio > 1")


@dataclass(frozen=True)
class PlateauConfig:
    """``plateau``: after ``patience`` steps the loss is still near its starting level and flat.

    The reference level is ln(num_classes) when the caller knows the number of classes, else the
    loss of step 0 while step 0 is in the window (without either, no verdict: a flat loss far into
    a run is indistinguishable from convergence).

    Attributes:
        enabled: run this detector.
        patience: steps after which the loss must have left the reference level. Default 100
            (SageMaker Debugger ``LossNotDecreasing`` compares every ``num_steps``=10 saved
            steps; per-step minibatch losses need a longer horizon, our measurement).
        chunk: steps per median. Default 10.
        stuck_fraction: still stuck when the last chunk median is at least this share of the
            reference. Default 0.9.
        max_fraction: ... and at most this share of it (far above is divergence, not a
            plateau). Default 1.5.
        min_improvement: ... and it improved by less than this share over the last ``patience``
            steps. Default 0.05 (SageMaker ``diff_percent`` is 0.1%, for averaged losses).
    """

    enabled: bool = True
    patience: int = 100
    chunk: int = 10
    stuck_fraction: float = 0.9
    max_fraction: float = 1.5
    min_improvement: float = 0.05

    def __post_init__(self) -> None:
        _positive_ints(self, "plateau", "patience", "chunk")
        if self.patience < self.chunk:
            raise ValueError("plateau.patience must be >= chunk")
        if not 0 < self.stuck_fraction < self.max_fraction or not 0 <= self.min_improvement < 1:
            raise ValueError("plateau needs 0 < stuck_fraction < max_fraction and "
                             "min_improvement in [0, 1)")


@dataclass(frozen=True)
class OscillationConfig:
    """``oscillation``: the smoothed loss swings up and down by large factors, making no progress.

    Over the last ``span`` steps, chunk medians (``chunk`` steps each) must (a) make at least
    ``min_moves`` alternating moves (up, down, up, ...) of at least ``move_ratio`` each (a zigzag:
    small wiggles do not count), (b) show no progress: the last third's median is at least
    ``no_progress`` times the first third's, and (c) sit at a level that is not converged: the
    median of the chunk medians is at least ``min_level`` x ln(num_classes) when known, else at
    least ``min_loss``.

    Attributes:
        enabled: run this detector.
        span: steps looked at. Default 100.
        chunk: steps per median. Default 5 (AUTOTRAINER ``unstable_loss`` counts swings of
            per-epoch accuracy; per-step losses need light smoothing first).
        move_ratio: factor a move must span. Default 2.0.
        min_moves: alternating moves. Default 4 (two full up-down cycles).
        no_progress: default 0.8.
        min_level: share of ln(C). Default 0.25 (our measurement: the noisy SGD run in
            tests/signatures, healthy, zigzags just as much at 0.13 ln(10): below this level the
            swings are minibatch noise around a low loss).
        min_loss: absolute floor without num_classes. Default 0.5 (same measurement; assumes a
            cross-entropy-like scale: set it for other losses).
    """

    enabled: bool = True
    span: int = 100
    chunk: int = 5
    move_ratio: float = 2.0
    min_moves: int = 4
    no_progress: float = 0.8
    min_level: float = 0.25
    min_loss: float = 0.5

    def __post_init__(self) -> None:
        _positive_ints(self, "oscillation", "span", "chunk", "min_moves")
        if self.span < 6 * self.chunk:
            raise ValueError("oscillation.span must be >= 6 * chunk")
        if not self.move_ratio > 1:
            raise ValueError("oscillation.move_ratio must be > 1")


@dataclass(frozen=True)
class InitialLossConfig:
    """``initial_loss``: the loss at step 0 is far from ln(num_classes) (Karpathy, "A Recipe for
    Training Neural Networks": verify the loss at init).

    Only judged when the caller passes ``num_classes`` and step 0 is in the window.

    Attributes:
        enabled: run this detector.
        high_ratio: fire above ``high_ratio * ln(C)``. Default 1.5 (our measurement: default
            PyTorch initialisation lands at 0.97x-1.07x on the runs in tests/signatures).
        low_ratio: fire below ``low_ratio * ln(C)``. Default 0.5.
    """

    enabled: bool = True
    high_ratio: float = 1.5
    low_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.low_ratio < 1 < self.high_ratio:
            raise ValueError("initial_loss needs 0 <= low_ratio < 1 < high_ratio")


def _positive_ints(cfg: object, name: str, *fields: str) -> None:
    for f in fields:
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}.{f} must be an int >= 1, got {v!r}")


def _chance(num_classes: int | None) -> float | None:
    try:
        c = int(num_classes) if num_classes is not None else 0
    except (TypeError, ValueError, OverflowError):
        return None
    return math.log(c) if c >= 2 else None


def zigzag_moves(values: Sequence[float], ratio: float) -> int:
    """Alternating moves of at least ``ratio`` (up by x ratio from a trough, then down by
    / ratio from a peak, ...) in a positive series: a swing count that ignores small wiggles."""
    moves, direction = 0, 0
    hi = lo = values[0] if values else 0.0
    for v in values[1:]:
        hi, lo = max(hi, v), min(lo, v)
        if direction <= 0 and lo > 0 and v >= lo * ratio:
            moves, direction, hi = moves + 1, 1, v
        elif direction >= 0 and v <= hi / ratio:
            moves, direction, lo = moves + 1, -1, v
    return moves


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
    ref = _chance(num_classes)
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
    pts = finite_losses(tail(records, config.span))
    if len(pts) < config.span * 0.9:
        return []
    meds = chunk_medians([v for _, v in pts], config.chunk)
    if len(meds) < 3:
        return []
    diffs = [b - a for a, b in zip(meds, meds[1:])]
    rising = sum(d > 0 for d in diffs) / len(diffs)
    lowest = min(meds)
    if rising < config.min_rising or not lowest > 0 or meds[-1] < config.ratio * lowest:
        return []
    ref = _chance(num_classes)
    if meds[-1] < (config.min_level * ref if ref is not None else config.min_loss):
        return []
    step = pts[-1][0]
    msg = (f"loss climbing for {len(pts)} steps: chunk medians {lowest:.4g} -> {meds[-1]:.4g} "
           f"({meds[-1] / lowest:.1f}x), rising in {rising:.0%} of chunks, at step {step}")
    return [make_verdict("divergence_growth", step, msg,
                         {"loss_median_start": meds[0], "loss_median_min": lowest,
                          "loss_median_last": meds[-1], "rising_fraction": rising},
                         DIVERGENCE_FIX)]


def detect_plateau(records: Sequence[StepRecord], config: PlateauConfig,
                   num_classes: int | None = None) -> list[Verdict]:
    """Report a loss still at its starting level after ``patience`` steps.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss (reference ln C), or None.

    Returns:
        One warning verdict at the last step, or nothing.
    """
    if not config.enabled or not records:
        return []
    last_step = step_of(records[-1])
    if last_step < config.patience:
        return []
    ref = _chance(num_classes)
    ref_name = "ln(num_classes)"
    if ref is None:
        first = records[0]
        ref = finite(getattr(first, "loss", None)) if step_of(first) == 0 else None
        ref_name = "the step-0 loss"
    if ref is None or not ref > 0:
        return []
    pts = finite_losses(tail(records, config.patience + config.chunk))
    if len(pts) < config.patience * 0.9:
        return []
    values = [v for _, v in pts]
    then = median(values[:config.chunk])
    now = median(values[-config.chunk:])
    if not config.stuck_fraction * ref <= now <= config.max_fraction * ref:
        return []
    if then > 0 and (then - now) / then >= config.min_improvement:
        return []
    msg = (f"loss still {now:.4g} at step {last_step} ({now / ref:.0%} of {ref_name} = {ref:.4g}); "
           f"{then:.4g} {config.patience} steps earlier")
    return [make_verdict("plateau", last_step, msg,
                         {"loss_median": now, "loss_median_before": then, "reference": ref},
                         PLATEAU_FIX)]


def detect_oscillation(records: Sequence[StepRecord], config: OscillationConfig,
                       num_classes: int | None = None) -> list[Verdict]:
    """Report a smoothed loss that swings by a large factor without converging.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss, or None.

    Returns:
        One warning verdict at the last step, or nothing.
    """
    if not config.enabled:
        return []
    pts = finite_losses(tail(records, config.span))
    if len(pts) < config.span * 0.9:
        return []
    meds = chunk_medians([v for _, v in pts], config.chunk)
    if len(meds) < 6:
        return []
    level = median(meds)
    ref = _chance(num_classes)
    floor = config.min_level * ref if ref is not None else config.min_loss
    lo, hi = min(meds), max(meds)
    if level < floor or not lo > 0:
        return []
    third = max(1, len(meds) // 3)
    if median(meds[-third:]) < config.no_progress * median(meds[:third]):
        return []
    moves = zigzag_moves(meds, config.move_ratio)
    if moves < config.min_moves:
        return []
    step = pts[-1][0]
    msg = (f"loss oscillating: {config.chunk}-step medians swing {lo:.4g}..{hi:.4g} "
           f"({moves} moves of >= {config.move_ratio:g}x in {len(pts)} steps) without progress, "
           f"at step {step}")
    return [make_verdict("oscillation", step, msg,
                         {"loss_median_min": lo, "loss_median_max": hi, "moves": moves,
                          "loss_median": level}, OSCILLATION_FIX)]


def detect_initial_loss(records: Sequence[StepRecord], config: InitialLossConfig,
                        num_classes: int | None = None) -> list[Verdict]:
    """Report a step-0 loss far from ln(num_classes).

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss; None: no verdict.

    Returns:
        One warning verdict at step 0, or nothing.
    """
    if not config.enabled or not records:
        return []
    ref = _chance(num_classes)
    first = records[0]
    if ref is None or step_of(first) != 0:
        return []
    loss = finite(getattr(first, "loss", None))
    if loss is None:
        return []
    if config.low_ratio * ref <= loss <= config.high_ratio * ref:
        return []
    msg = (f"loss at step 0 is {loss:.4g}, expected about ln({num_classes}) = {ref:.4g} "
           f"({loss / ref:.2f}x)")
    return [make_verdict("initial_loss", 0, msg, {"loss": loss, "expected": ref},
                         INITIAL_LOSS_FIX)]
