"""When the per-layer probes sample a step (agent/probes.py): the dense head of a run, the
back-off, the steady cadence, and which sampled steps are full. Pure functions of the step."""

from __future__ import annotations

__all__ = ["DENSE_STEPS", "sampled_at", "full_at"]

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
    """True when step ``step`` is a full sample: per-module norms and update ratios as well as
    the activations. A sampled step (:func:`sampled_at`) that is not a full one measures the
    activations only (one max reduction per activation call).

    Args:
        step, every, dense, first: as for :func:`sampled_at`.

    Returns:
        With ``r = step - first``: in the dense head (r < ``dense``) only r = 0, 1, 2, 4, 8 and
        the steps of the steady cadence (``step % every == 0``; all of them for ``every`` = 1);
        the head's other steps are activation-only (an early death is seen at once, the norms of
        the first steps at a doubling gap); from there on every sampled step. So of the 73
        sampled steps among a run's first 200 (``every`` = 50), 62 are full, and each full one
        costs four fused float32 norm passes and one parameter copy (:func:`_norms`).
    """
    r = step - first
    if 0 <= r < dense:
        return r & (r - 1) == 0 or step % every == 0
    return sampled_at(step, every, dense, first)
