"""Checks 3, 4 and 7: the output layer against the loss, the first loss against ln C, the shapes.

All three read the aten-level :class:`~.trace.Trace` of one forward + loss: what flows into the
loss op is a fact of the trace, whatever the modules are called.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .lossinfo import LossInfo, producer_of
from .result import FAIL, PASS, WARN, Check
from .trace import Trace

__all__ = ["check_output_vs_loss", "check_initial_loss", "check_shapes", "INIT_LOSS_PASS", "INIT_LOSS_FAIL"]

# Ops that only move or reshape data: a softmax seen through them is still the softmax.
_PASSTHROUGH = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "contiguous", "clone",
                "squeeze", "unsqueeze", "flatten", "_to_copy", "slice", "select", "alias", "to",
                "_reshape_alias", "expand"}
_NORMALIZERS = {"_softmax": "softmax", "_log_softmax": "log_softmax", "sigmoid": "sigmoid"}
# consumer op -> what it applies itself
_CONSUMERS = {"_log_softmax": "log_softmax (CrossEntropyLoss applies it)",
              "binary_cross_entropy_with_logits": "sigmoid (BCEWithLogitsLoss applies it)",
              "nll_loss_forward": "log (NLLLoss expects log-probabilities)",
              "nll_loss2d_forward": "log (NLLLoss expects log-probabilities)"}

#: |first loss - ln C| <= INIT_LOSS_PASS * ln C passes. For logits with a small spread s (std over
#: classes) the expected cross-entropy is ln C + s^2/2 (second-order expansion of logsumexp), so
#: 25% of ln C allows a logit std up to sqrt(0.5 ln C) (1.07 for C=10): an ordinary init.
INIT_LOSS_PASS = 0.25
#: A first loss above (1 + INIT_LOSS_FAIL) * ln C or below ln C / (1 + INIT_LOSS_FAIL) fails: the
#: model starts confidently wrong (logit std > sqrt(2 ln C)), or it is right before training
#: (labels leaking into the inputs, or the loss is not over C classes).
INIT_LOSS_FAIL = 1.0


def _origin(trace: Trace, tensor_id: int, before: int) -> tuple[str | None, list[str]]:
    """Follow ``tensor_id`` back through pass-through ops to the op that made it."""
    chain: list[str] = []
    while True:
        found = producer_of(trace, tensor_id, before)
        if found is None:
            return None, chain
        idx, op = found
        chain.append(op.name)
        if op.name in _NORMALIZERS:
            return op.name, chain
        if op.name not in _PASSTHROUGH or not op.inputs:
            return None, chain
        tensor_id, before = op.inputs[0], idx


def check_output_vs_loss(trace: Trace) -> Check:
    """Softmax / log_softmax / sigmoid applied before a loss that applies it again.

    FAIL: softmax into log_softmax (softmax twice), softmax into nll_loss (NLL of probabilities),
    sigmoid into BCE-with-logits or into log_softmax. WARN: log_softmax twice (idempotent, so
    harmless, but redundant).
    """
    for i, op in enumerate(trace.ops):
        if op.name not in _CONSUMERS or not op.inputs:
            continue
        origin, chain = _origin(trace, op.inputs[0], i)
        if origin is None:
            continue
        path = " -> ".join(list(reversed(chain)) + [op.name])
        ev = {"ops": path, "phase": op.phase}
        applied = _NORMALIZERS[origin]
        if origin == "_log_softmax" and op.name == "_log_softmax":
            return Check("output_vs_loss", WARN, "log_softmax is applied twice (harmless: it is idempotent)",
                         ev, "drop the model's log_softmax and feed logits to CrossEntropyLoss")
        if origin == "_log_softmax":
            continue  # log_softmax into nll_loss is the textbook pairing
        if origin == "sigmoid" and op.name.startswith("nll"):
            continue
        return Check("output_vs_loss", FAIL, f"the model applies {applied} and the loss applies "
                     f"{_CONSUMERS[op.name]} again", ev,
                     "use logits + CrossEntropyLoss (or BCEWithLogitsLoss): remove the final "
                     f"{applied} from the model; don't apply softmax twice")
    return Check("output_vs_loss", PASS, "no softmax/sigmoid feeds a loss that applies it again", {})


def check_initial_loss(trace: Trace, info: LossInfo, num_classes: int | None) -> Check:
    """The first loss against ln C for a C-class cross-entropy (tolerances: INIT_LOSS_PASS/FAIL)."""
    c = num_classes or info.num_classes
    loss = float(trace.loss.detach()) if trace.loss is not None else float("nan")
    if info.kind != "ce" or not c or c < 2:
        return Check("initial_loss", PASS, f"first loss {loss:.4g} (not a C-class cross-entropy: no ln C "
                     "baseline)", {"loss": loss, "loss_kind": info.kind})
    expected = math.log(c)
    ev = {"loss": loss, "ln_C": expected, "num_classes": c, "ratio": loss / expected,
          "tolerance": f"PASS within {INIT_LOSS_PASS:.0%} of ln C (logits std <= sqrt(0.5 ln C)); "
                       f"FAIL beyond a factor {1 + INIT_LOSS_FAIL:g}"}
    fix = ("at initialization a C-class classifier should predict near-uniformly (loss ~ ln C); a "
           "large deviation points at the initialization (scale of the last layer) or the data")
    if not math.isfinite(loss):
        return Check("initial_loss", FAIL, f"the first loss is {loss}", ev, fix)
    ratio = loss / expected
    if ratio > 1 + INIT_LOSS_FAIL or ratio < 1 / (1 + INIT_LOSS_FAIL):
        return Check("initial_loss", FAIL, f"first loss {loss:.4g} vs ln {c} = {expected:.4g} "
                     f"({ratio:.2f}x)", ev, fix)
    if abs(loss - expected) > INIT_LOSS_PASS * expected:
        return Check("initial_loss", WARN, f"first loss {loss:.4g} vs ln {c} = {expected:.4g} "
                     f"({ratio:.2f}x)", ev, fix)
    return Check("initial_loss", PASS, f"first loss {loss:.4g} ~ ln {c} = {expected:.4g}", ev)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def _broadcasts(trace: Trace) -> list[dict[str, Any]]:
    """Loss-side ops whose output is larger than every input: an outer-product broadcast."""
    found = []
    for op in trace.ops:
        if op.phase != "loss" or not op.out_shapes or not op.in_shapes:
            continue
        big_in = max(_numel(s) for s in op.in_shapes)
        if op.name == "expand" and _numel(op.in_shapes[0]) > 1 and _numel(op.out_shapes[0]) > big_in:
            found.append({"op": op.name, "from": list(op.in_shapes[0]), "to": list(op.out_shapes[0])})
        elif (op.name != "expand" and len(op.in_shapes) >= 2 and len(set(op.in_shapes)) > 1
              and min(_numel(s) for s in op.in_shapes) > 1 and _numel(op.out_shapes[0]) > big_in):
            found.append({"op": op.name, "inputs": [list(s) for s in op.in_shapes],
                          "output": list(op.out_shapes[0])})
    return found


def check_shapes(trace: Trace) -> Check:
    """Each module's output shape (a table in ``evidence["table"]``), a non-scalar loss, and
    loss-side broadcasting."""
    table = [list(row) for row in trace.module_shapes]
    ev: dict[str, Any] = {"table": table[:200]}
    loss = trace.loss
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        ev["loss_shape"] = list(loss.shape)
        return Check("shapes", FAIL, f"the loss has shape {list(loss.shape)}, not a scalar", ev,
                     "reduce it (loss.mean()); backward of a non-scalar loss needs an explicit gradient")
    bad = _broadcasts(trace)
    if bad:
        ev["broadcasts"] = bad[:5]
        first = bad[0]
        what = (f"{first['from']} -> {first['to']}" if "from" in first
                else f"{first['inputs']} -> {first['output']}")
        return Check("shapes", FAIL, f"the loss broadcasts {what} ({first['op']}): e.g. [B,1] against [B] "
                     "makes a [B,B] loss", ev,
                     "print the shape of the output and the target; squeeze the output (out.squeeze(-1)) "
                     "or reshape the target so both are [B]")
    out = table[-1][2] if table else "?"
    return Check("shapes", PASS, f"{len(table)} module calls; model output {out}; no broadcasting in the loss", ev)
