"""Is the loss at its floor? The look at the loss that the gradient and update rules take.

The method reads a gradient together with the loss it came from: a tiny gradient at a loss near
its floor is convergence (there is nothing left to learn), not a vanishing gradient; a grad norm
that jumps from 3e-7 to 6e-5 while the loss stays at 1e-5 is noise among near-zero numbers, not
an explosion; an update of 1e-10 of the weights, or one that rounds to exactly 0 in float32, is
what Adam does once the gradient is ~0. Without this look, every run that fits its data (the
method's own first check: "overfit one batch to ~0 loss") raises vanishing, exploding and
update-ratio alerts (issue 21).

Thresholds (one place, used by every rule that asks):

- :data:`CONVERGED_SHARE` = 1e-3: the loss is at its floor when the median of its last
  :data:`RECENT_STEPS` finite values is at most this share of the reference level: ln(C) for a
  C-class loss when the caller knows C, else the highest finite loss in the window. A
  cross-entropy at 1e-3 x ln(10) = 2.3e-3 puts p = 0.998 on the right class: nothing is left to
  learn (our choice; the healthy runs in tests/signatures/test_healthy_corpus.py that fit their
  data go below 1e-4, the faulty runs in tests/signatures/scenarios.py stay above 0.05 x ln C).
- :data:`CONVERGED_LOSS` = 1e-4: or at most this, absolute (a window that holds only the
  converged tail has no higher loss to compare with; assumes a cross-entropy- or MSE-like scale).
- :data:`RESCALE_DROP` = 1e3: a loss that fell from above the floor to below it by this factor
  in one step did not converge there, it was rescaled (the planted fault "loss divided by 1e9"
  in tests/signatures/scenarios.py drops 1e9x in one step; the fastest healthy descent in the
  corpus, Adam at lr 0.05 on 16 samples, falls at most ~30x per step).
- A loss that goes negative (a log-density) has no floor at 0: never "at its floor" here.
"""

from __future__ import annotations

from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import chance_loss, finite_losses, median

__all__ = ["CONVERGED_SHARE", "CONVERGED_LOSS", "RESCALE_DROP", "RECENT_STEPS", "loss_floor_bar",
           "loss_at_floor"]

CONVERGED_SHARE = 1e-3
CONVERGED_LOSS = 1e-4
RESCALE_DROP = 1e3
#: finite losses whose median is the loss level now
RECENT_STEPS = 5


def loss_floor_bar(values: Sequence[float], num_classes: int | None) -> float:
    """The loss level at or below which a run counts as converged (see the module docstring).

    Args:
        values: the window's finite losses, oldest first (may be empty).
        num_classes: C of a C-class loss, or None.

    Returns:
        ``max(CONVERGED_LOSS, CONVERGED_SHARE * reference)``.
    """
    ref = chance_loss(num_classes)
    if ref is None:
        ref = max(values, default=0.0)
    return max(CONVERGED_LOSS, CONVERGED_SHARE * ref)


def loss_at_floor(records: Sequence[StepRecord], num_classes: int | None = None) -> bool:
    """True when the window's loss has converged to its floor (see the module docstring).

    Args:
        records: step records, oldest first (the whole window: the reference level and the
            rescale check look at all of it, the level now at the last :data:`RECENT_STEPS`).
        num_classes: C of a C-class loss, or None.

    Returns:
        False on too little finite data, a negative loss, a loss above the bar, or a loss that
        got below the bar by a one-step drop of :data:`RESCALE_DROP` or more. Never raises.
    """
    vals = [v for _, v in finite_losses(records)]
    if len(vals) < RECENT_STEPS:
        return False
    level = median(vals[-RECENT_STEPS:])
    if level < 0 or min(vals) < 0:
        return False
    bar = loss_floor_bar(vals, num_classes)
    if level > bar:
        return False
    for before, after in zip(vals, vals[1:]):
        if before > bar and after <= bar and before >= RESCALE_DROP * max(after, 0.0):
            return False  # rescaled (a unit bug), not converged
    return True
