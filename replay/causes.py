"""Likely cause and fix for a localized non-finite value, from the method's NaN/Inf table.

Source: ``debugging-and-diagnosis.txt``, "NaN / Inf Troubleshooting": learning rate too large,
division by zero / log(0), gradient explosion, mixed precision overflow (float16 max 65504), data
containing NaN, learning-rate scheduler division by zero. Pure function over the verdict's fields.
"""

from __future__ import annotations

from typing import Any

__all__ = ["likely_cause", "FP16_MAX"]

#: Largest finite float16 (IEEE 754 binary16).
FP16_MAX = 65504.0

_DIV_OPS = {"aten.div", "aten.div_", "aten.reciprocal", "aten.rsqrt", "aten.true_divide",
            "aten.addcdiv", "aten.addcdiv_", "aten._foreach_div", "aten._foreach_div_",
            "aten._foreach_addcdiv_", "aten._foreach_addcdiv"}
_LOG_OPS = {"aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy"}
_SQRT_OPS = {"aten.sqrt", "aten.pow", "aten.rsqrt", "aten.norm", "aten.linalg_vector_norm"}


def _any_zero(inputs: list[dict[str, Any]]) -> bool:
    return any((s.get("zeros") or 0) > 0 for s in inputs)


def likely_cause(phase: str, op: str | None, kind: str | None, inputs: list[dict[str, Any]],
                 output: dict[str, Any], *, lr: float | None = None,
                 clip: bool = False, node: str | None = None) -> tuple[str, str]:
    """Return ``(cause, fix)`` for a verdict.

    Args:
        phase: ``data`` | ``forward`` | ``backward`` | ``optimizer`` | ``none``.
        op: aten op of the birth, if any.
        kind: ``nan`` or ``inf`` (what was born).
        inputs / output: tensor statistics (see ``replay.trace.tensor_stats``).
        lr: the learning rate at the step (non-finite -> scheduler).
        clip: the birth happened inside gradient clipping.
        node: autograd node name in backward.
    """
    if phase == "data":
        return ("the batch itself holds NaN/Inf (upstream data cleaning missed them)",
                "clean the data; check inputs with torch.isnan(x).any() in the data pipeline")
    if phase == "none":
        return ("the step re-ran with every value finite",
                "if the run was non-finite here, suspect non-determinism or hardware; re-run on another device")
    if lr is not None and lr != lr or lr in (float("inf"), float("-inf")):
        return ("the learning-rate scheduler produced a non-finite learning rate (division by zero)",
                "check the LambdaLR / warmup arguments (e.g. warmup_steps=0) and ReduceLROnPlateau settings")
    if clip:
        return ("gradient clipping turned an Inf gradient into NaN (max_norm / inf = 0, then inf * 0)",
                "clipping only masks the upstream problem: fix the Inf gradient's origin named in evidence, "
                "or skip steps whose grad norm is non-finite (GradScaler does)")
    dtypes = {s.get("dtype") for s in inputs} | {output.get("dtype")}
    big = max([s.get("finite_max_abs") or 0.0 for s in inputs] + [0.0])
    if "float16" in dtypes and kind == "inf" and (output.get("posinf", 0) or output.get("neginf", 0)):
        return (f"float16 overflow: a value exceeded {FP16_MAX:g}, the largest float16",
                "use torch.amp GradScaler/autocast so this op runs in float32, or rescale; check "
                "custom ops support fp16")
    if op in _LOG_OPS and _any_zero(inputs):
        return ("log(0): a log of an exact zero (e.g. a probability that underflowed)",
                "add eps inside the log or compute in log space (log_softmax, BCEWithLogitsLoss)")
    if phase == "optimizer":
        eps_zero = any(s.get("zeros") for s in inputs) and op in _DIV_OPS
        if eps_zero:
            return ("division by zero in the optimizer step (e.g. Adam's eps lost in float16 with "
                    "a zero second moment)",
                    "keep optimizer state in float32 (master weights) or raise eps above the dtype's "
                    "smallest normal")
        return ("the optimizer step made parameters non-finite (learning rate too large: "
                "parameters diverge and overflow)",
                "lower the learning rate; find the right range with an LR range test; clip gradients")
    if op in _DIV_OPS and _any_zero(inputs):
        where = "in backward" if phase == "backward" else "in forward"
        return (f"division by zero {where} (a zero denominator, e.g. a zero standard deviation in "
                "a normalization, or the gradient of sqrt/norm at exactly 0)",
                "add eps to the denominator (x / (std + eps), sqrt(x + eps)); avoid extreme values in data")
    if op in _SQRT_OPS and kind == "nan":
        return ("square root or power of a negative number", "clamp the argument to >= 0 or add eps")
    if phase == "backward":
        if node and "AccumulateGrad" in node:
            return ("gradients accumulated across steps until they overflowed (zero_grad missing?)",
                    "call optimizer.zero_grad() every step, or declare gradient accumulation")
        return ("gradient explosion: the chain rule multiplied large factors until they overflowed",
                "clip gradients with clip_grad_norm_ and lower the learning rate")
    if kind == "nan" and op in {"aten._softmax", "aten.softmax", "aten._log_softmax"}:
        return ("softmax over a row where every position is -inf (fully masked)",
                "make sure every row keeps at least one unmasked position, or use a large finite "
                "negative fill value instead of -inf")
    if big > 1e4:
        return ("values overflowed in forward (weights or activations grew huge: learning rate "
                "too large)",
                "lower the learning rate; add normalization or gradient clipping")
    return ("an op produced a non-finite value from finite inputs",
            "inspect the op's inputs in evidence; add eps / clamp where a denominator or log "
            "argument can reach zero")
