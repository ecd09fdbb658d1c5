"""The loss curve: plateau, oscillation, initial loss (divergence: :mod:`.divergence`).

The method reads training curves: a loss that diverges means the learning rate is too large or
something upstream broke; a loss that does not decrease means labels, normalisation, output/loss
mismatch, learning rate or gradients not applied (the checklist, in that order); a loss that
oscillates violently without converging means learning rate too large or batch too small; and
the loss at initialisation should be about ln(C) for C classes.

Per-step minibatch losses are noisy and heavy-tailed, so every rule here compares medians (of a
few steps, or of chunks of steps) rather than single values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import (
    Verdict,
    chance_loss,
    finite,
    finite_losses,
    make_verdict,
    median,
    positive_ints,
    step_of,
    tail,
    tail_chunk_medians,
)

__all__ = ["PlateauConfig", "OscillationConfig", "InitialLossConfig", "detect_plateau",
           "detect_oscillation", "detect_initial_loss"]

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
        positive_ints(self, "plateau", "patience", "chunk")
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
        positive_ints(self, "oscillation", "span", "chunk", "min_moves")
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
        low_ratio: fire below ``low_ratio * ln(C)``. Default 0.0 (off): a loss far below ln(C)
            at step 0 is a pretrained, fine-tuned or resumed model, not a fault of the
            initialisation (issue 21's corpus: fine-tuning starts at 0.08 ln 10). Set 0.5 for
            runs known to start from scratch.
    """

    enabled: bool = True
    high_ratio: float = 1.5
    low_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.low_ratio < 1 < self.high_ratio:
            raise ValueError("initial_loss needs 0 <= low_ratio < 1 < high_ratio")



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
    ref = chance_loss(num_classes)
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
    got = tail_chunk_medians(records, config.span, config.chunk, 6)
    if got is None:
        return []
    pts, meds = got
    level = median(meds)
    ref = chance_loss(num_classes)
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
    ref = chance_loss(num_classes)
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
