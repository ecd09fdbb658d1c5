"""The one rule for "this step is non-finite", used by the agent (capture on it) and by the
daemon's ``nonfinite`` signature (alert on it), so the two never disagree (issue 9: the agent
captured on a nan learning rate, the signature did not alert).

A step counts as non-finite when its loss, its learning rate, a parameter (a sampled module's
``param_norm``, or ``param_nonfinite``) or its input batch (``input_nonfinite``) is nan/inf, or
its global grad norm is, unless the optimizer skipped the step: GradScaler's skipped steps carry
inf gradients by design. Pure functions over a :class:`~sentineld.contracts.records.StepRecord`
(or anything with its attributes); a malformed record never raises, it just counts as finite
where a value cannot be read.

An incident is a run of non-finite steps; it is over once :data:`REARM_STEPS` finite steps in a
row followed it (the agent re-arms its capture then, the daemon sends the recovery notice), and
the next non-finite step opens a new one (:func:`current_incident`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["is_nonfinite", "nonfinite_reasons", "current_incident", "recovered_at", "Incident",
           "INPUT_REASON", "REARM_STEPS"]

#: Finite steps in a row after which a non-finite incident is over. 20, not more: a run that
#: recovers (GradScaler skipped the step, one bad batch) and breaks again 50 steps later is a
#: second incident with its own capture and alert (issue 10); not fewer: a run that is NaN on
#: every few steps is one incident, not one page per step.
REARM_STEPS = 20

#: The reason given for a non-finite input batch (the signature's data-specific fix keys on it).
INPUT_REASON = "input batch"


def _bad(x: Any) -> bool:
    """True for a number that is nan/inf; False for None, bools and non-numbers."""
    if x is None or isinstance(x, bool):
        return False
    try:
        return not math.isfinite(x)
    except (TypeError, ValueError, OverflowError):
        return False


def _bad_layers(record: Any) -> list[str]:
    layers = getattr(record, "layers", None)
    if not layers or not hasattr(layers, "items"):
        return []
    try:
        return [str(name) for name, st in layers.items() if _bad(getattr(st, "param_norm", None))]
    except Exception:  # noqa: BLE001 - a malformed layers mapping is ignored, never raised
        return []


def is_nonfinite(record: Any) -> bool:
    """Does ``record`` hold a non-finite value that counts (see the module docstring)?

    Cheap on a clean record (a few ``math.isfinite`` calls): the agent runs it every step.
    """
    try:  # fast path for a well-formed clean record
        isfinite = math.isfinite
        if (isfinite(record.loss) and (record.grad_norm is None or isfinite(record.grad_norm))
                and (record.lr is None or isfinite(record.lr))
                and record.param_nonfinite is not True and record.input_nonfinite is not True
                and not record.layers):
            return False
    except Exception:  # noqa: BLE001 - anything odd takes the careful path
        pass
    return bool(nonfinite_reasons(record))


def nonfinite_reasons(record: Any) -> list[str]:
    """What is non-finite in ``record``, in words, e.g. ``["loss=nan", "learning rate lr=inf"]``.

    Returns:
        An empty list for a finite step. Order: the input batch (a non-finite batch makes all
        the rest non-finite, so it is named first), loss, grad norm, learning rate, then the
        parameters: the sampled modules whose parameters are non-finite (at most 3 named), or
        just "parameters" when only ``param_nonfinite`` says so.
    """
    reasons = []
    if getattr(record, "input_nonfinite", None) is True:
        reasons.append(INPUT_REASON)
    loss: Any = getattr(record, "loss", None)
    if _bad(loss):
        reasons.append(f"loss={float(loss)}")
    gn: Any = getattr(record, "grad_norm", None)
    if _bad(gn) and not getattr(record, "optimizer_skipped", False):
        reasons.append(f"grad_norm={float(gn)}")
    lr: Any = getattr(record, "lr", None)
    if _bad(lr):
        reasons.append(f"learning rate lr={float(lr)}")
    bad = _bad_layers(record)
    if bad:
        reasons.append("parameters of " + ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    elif getattr(record, "param_nonfinite", None) is True:
        reasons.append("parameters")
    return reasons


@dataclass(frozen=True)
class Incident:
    """The incident still open at the end of a window of records.

    Attributes:
        first: index (into the window) of its first non-finite record.
        nonfinite_steps: its non-finite records.
        finite_before: finite records in a row right before ``first`` (0 when ``first`` is 0:
            the incident may have begun before the window). ``>= REARM_STEPS`` means it follows
            a recovery: a new incident, not the continuation of an earlier one.
    """

    first: int
    nonfinite_steps: int
    finite_before: int


def current_incident(records: Sequence[Any], rearm_steps: int = REARM_STEPS) -> Incident | None:
    """The incident open at the end of ``records`` (oldest first), or None when the window has
    no non-finite step or its last one was followed by ``rearm_steps`` finite ones (recovered).

    The agent's :class:`~sentineld.agent.incidents.IncidentPolicy` applies the same rule step by
    step, so its captures and the daemon's alerts name the same first steps.
    """
    bad = [is_nonfinite(r) for r in records]
    if not any(bad):
        return None
    last = max(i for i, b in enumerate(bad) if b)
    if len(bad) - 1 - last >= rearm_steps:
        return None
    first, count, streak = last, 0, 0
    for i in range(last, -1, -1):
        if bad[i]:
            first, count, streak = i, count + 1, 0
            continue
        streak += 1
        if streak >= rearm_steps:
            break
    before = 0
    for i in range(first - 1, -1, -1):
        if bad[i]:
            break
        before += 1
    return Incident(first=first, nonfinite_steps=count, finite_before=before)


def recovered_at(records: Sequence[Any], since_step: int, rearm_steps: int = REARM_STEPS) -> int | None:
    """The step at which the incident that began at ``since_step`` was over: the last of the first
    ``rearm_steps`` finite steps in a row after it, or None when ``records`` do not show it."""
    streak = 0
    for r in records:
        step = getattr(r, "step", None)
        if not isinstance(step, int) or step < since_step:
            continue
        streak = 0 if is_nonfinite(r) else streak + 1
        if streak >= rearm_steps:
            return step
    return None
