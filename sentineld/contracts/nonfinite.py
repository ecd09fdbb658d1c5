"""The one rule for "this step is non-finite", used by the agent (capture on it) and by the
daemon's ``nonfinite`` signature (alert on it), so the two never disagree (issue 9: the agent
captured on a nan learning rate, the signature did not alert).

A step counts as non-finite when its loss, its learning rate, a parameter (a sampled module's
``param_norm``, or ``param_nonfinite``) or its input batch (``input_nonfinite``) is nan/inf, or
its global grad norm is, unless the optimizer skipped the step: GradScaler's skipped steps carry
inf gradients by design. Pure functions over a :class:`~sentineld.contracts.records.StepRecord`
(or anything with its attributes); a malformed record never raises, it just counts as finite
where a value cannot be read.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_nonfinite", "nonfinite_reasons", "INPUT_REASON"]

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
        An empty list for a finite step. Order: loss, grad norm, learning rate, parameters,
        input batch, then the sampled modules whose parameters are non-finite (at most 3 named).
    """
    reasons = []
    loss: Any = getattr(record, "loss", None)
    if _bad(loss):
        reasons.append(f"loss={float(loss)}")
    gn: Any = getattr(record, "grad_norm", None)
    if _bad(gn) and not getattr(record, "optimizer_skipped", False):
        reasons.append(f"grad_norm={float(gn)}")
    lr: Any = getattr(record, "lr", None)
    if _bad(lr):
        reasons.append(f"learning rate lr={float(lr)}")
    if getattr(record, "param_nonfinite", None) is True:
        reasons.append("parameters")
    if getattr(record, "input_nonfinite", None) is True:
        reasons.append(INPUT_REASON)
    bad = _bad_layers(record)
    if bad:
        reasons.append("parameters of " + ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    return reasons
