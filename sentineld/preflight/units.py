"""Check 9: dead or saturated units at initialization.

The method: "activation distributions should not collapse ... not saturate (for ReLU, the
dead-region ratio should not be excessively high) ... typically caused by a learning rate that is
too large or improper initialization". A unit is dead when its ReLU output is 0 for every sample
(and position) of the batch; a sigmoid/tanh unit is saturated when it sits within 1% of its
bounds everywhere: its gradient is then ~0 too.
"""

from __future__ import annotations

from typing import Any

import torch

from .result import FAIL, PASS, WARN, Check
from .trace import Trace

__all__ = ["check_dead_units", "unit_inactive", "DEAD_WARN", "DEAD_FAIL"]

#: A layer with more than this share of inactive units warns. At a default init a unit is off for
#: all 32 samples of a batch with probability ~2^-32 when its pre-activation is centred: a
#: quarter of them off means the pre-activations are not centred.
DEAD_WARN = 0.25
#: A layer with at least this share inactive fails: almost no signal or gradient passes it.
DEAD_FAIL = 0.9


def _unit_axis(t: torch.Tensor) -> int:
    """Channels (dim 1) of images and 2-D features; the last dim of [B, T, D] sequences."""
    return t.dim() - 1 if t.dim() == 3 else 1


def unit_inactive(op: str, out: torch.Tensor) -> torch.Tensor:
    """Bool per unit: dead (ReLU-like) or saturated (sigmoid, tanh) at every sample and position.

    Args:
        op: the aten op name (:data:`~.trace.ACTIVATION_OPS`).
        out: its output, ``[B, units]``, ``[B, C, ...]`` or ``[B, T, units]``.
    """
    axis = _unit_axis(out)
    per = out.detach().movedim(axis, 0).reshape(out.shape[axis], -1).float()
    if op.startswith("relu"):
        off = per <= 0
    elif op.startswith("hardtanh"):
        # clamped at one of its bounds everywhere (bounds unknown here: ReLU6 0/6, Hardtanh -1/1)
        return (per.amax(dim=1) == per.amin(dim=1)) & ((per <= 0).all(dim=1) | (per.amin(dim=1) >= 1))
    elif op == "sigmoid":
        off = (per < 0.01) | (per > 0.99)
    else:  # tanh
        off = per.abs() > 0.99
    return off.all(dim=1)


def check_dead_units(trace: Trace) -> Check:
    """Share of dead/saturated units per activation layer of the traced forward (DEAD_WARN/FAIL)."""
    rows: list[dict[str, Any]] = []
    for i, (op, phase, out) in enumerate(trace.activations):
        if phase != "model" or out.dim() < 2 or out.shape[0] < 2:
            continue
        inactive = unit_inactive(op, out)
        rows.append({"layer": i, "op": op, "shape": list(out.shape), "units": int(inactive.numel()),
                     "inactive": int(inactive.sum()), "share": float(inactive.float().mean())})
    if not rows:
        return Check("dead_units", PASS, "no ReLU/sigmoid/tanh activations in the model's forward", {"layers": []})
    worst = max(rows, key=lambda r: r["share"])
    ev = {"layers": rows[:50], "worst": worst}
    kind = "dead" if worst["op"].startswith("relu") else "saturated"
    msg = (f"activation #{worst['layer']} ({worst['op']}, {worst['shape']}): {worst['inactive']}/"
           f"{worst['units']} units {kind} on the whole batch at initialization")
    fix = ("check the initialization (a large negative bias, a bad std) and the input scale; use "
           "Kaiming init for ReLU, or LeakyReLU/GELU, or normalization before the activation")
    if worst["share"] >= DEAD_FAIL:
        return Check("dead_units", FAIL, msg, ev, fix)
    if worst["share"] > DEAD_WARN:
        return Check("dead_units", WARN, msg, ev, fix)
    return Check("dead_units", PASS, f"{len(rows)} activation layers; at most {worst['share']:.0%} of a "
                 "layer's units inactive", ev)
