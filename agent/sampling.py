"""When the per-layer probes sample a step (agent/probes.py): the dense head of a run, the
back-off, the steady cadence, and which sampled steps are full. Pure functions of the step."""

from __future__ import annotations

__all__ = ["DENSE_STEPS", "sampled_at", "full_at", "norms_at"]

#: Steps sampled one after the other at the start of a run. 16: a learning rate high enough to
#: kill units does so within the first few steps (tests/signatures/test_dead_onset.py: step ~2);
#: the gap then grows with the step (at most step / 16), so the onset of an early death is named
#: within a few steps, as the method asks of the first steps ("check the first steps").
DENSE_STEPS = 16


def sampled_at(step: int, every: int, dense: int = DENSE_STEPS, first: int = 0) -> bool:
    """True when step ``step`` is sampled.

    Args:
        step: the optimizer step (>= ``first``).
        every: the steady sampling period (>= 1).
        dense: steps sampled one after the other first (0: plain ``step % every == 0``).
        first: the run's first step (a resumed run starts later; it samples densely again).

    Returns:
        With ``r = step - first``: True for r < ``dense``; then for r a multiple of the gap
        2**floor(log2(r // dense)) while that gap is below ``every``; then for
        ``step % every == 0`` (the steady cadence, aligned as without a dense head).
    """
    r = step - first
    if r < dense:
        return True
    if dense > 0:
        gap = 1 << ((r // dense).bit_length() - 1)
        if gap < every:
            return r % gap == 0
    return step % every == 0


def full_at(step: int, every: int, dense: int = DENSE_STEPS, first: int = 0) -> bool:
    """True when step ``step`` is a full sample: update ratios (a copy of the parameters around
    the optimizer step, two more norm passes) as well as the norms and activations of
    :func:`norms_at`.

    Args:
        step, every, dense, first: as for :func:`sampled_at`.

    Returns:
        With ``r = step - first``, a sampled step (:func:`sampled_at`) that is r = 0 or a power
        of two, or on the steady cadence (``step % every == 0``; all of them for ``every`` = 1).
        So of the 73 sampled steps among a run's first 200 (``every`` = 50), 11 are full (0, 1,
        2, 4, 8, 16, 32, 50, 64, 100, 128), and of those between steps 400 and 1000 three (400,
        512, 800). The update-based rules (``update_ratio``, ``gradients_not_applied``) read full
        samples; the gradient rules (``missing_gradients``, ...) every :func:`norms_at` step.
    """
    r = step - first
    if not sampled_at(step, every, dense, first):
        return False
    return r >= 0 and (r & (r - 1) == 0 or step % every == 0)


def norms_at(step: int, every: int, dense: int = DENSE_STEPS, first: int = 0) -> bool:
    """True when step ``step`` takes the per-module grad and parameter norms (a :func:`full_at`
    step, or any sampled step past the dense head).

    The grad norms come for free from the per-parameter norms the global grad norm takes anyway
    (``agent/readback.py`` ``grad_norm``), the parameter norms are one fused pass: so every
    sampled step of the back-off reports them, and a module that loses its gradient (a layer
    detached mid-run) is named within a few steps (``missing_gradients``: three samples;
    tests/signatures/test_runs.py bounds it at 10 steps). The dense head's other steps measure
    the activations only (one max reduction per activation call), as before.

    Args:
        step, every, dense, first: as for :func:`sampled_at`.
    """
    r = step - first
    if not sampled_at(step, every, dense, first):
        return False
    return r >= dense or full_at(step, every, dense, first)
