"""Likely cause and fix of a localized non-finite value, from the method's NaN/Inf table.

Source: ``debugging-and-diagnosis.txt``, "NaN / Inf Troubleshooting", whose rows are (in the
method's order of likelihood) learning rate too large, division by zero / log(0), gradient
explosion, mixed precision (AMP) overflow (float16's largest value is 65504), data containing NaN,
learning-rate scheduler division by zero; plus the "Common Bug List" row "forgot
optimizer.zero_grad()". Each verdict names the row it comes from. Pure function over
:class:`Facts`; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Facts", "Cause", "likely_cause", "FP16_MAX", "ROWS"]

#: Largest finite float16 (IEEE 754 binary16).
FP16_MAX = 65504.0

#: The method's table rows, as cited in :attr:`Cause.row`.
ROWS = {
    "lr": "Learning rate too large",
    "div": "Division by zero / log(0)",
    "explode": "Gradient explosion",
    "amp": "Mixed precision (AMP) overflow",
    "data": "Data itself contains NaN",
    "sched": "Learning rate scheduler division by zero",
    "zero_grad": "Forgot optimizer.zero_grad() (common bug list)",
    "none": "",
}

_DIV_OPS = {"aten.div", "aten.div_", "aten.reciprocal", "aten.rsqrt", "aten.true_divide",
            "aten.addcdiv", "aten.addcdiv_", "aten._foreach_div", "aten._foreach_div_",
            "aten._foreach_addcdiv_", "aten._foreach_addcdiv", "aten.remainder", "aten.fmod"}
_LOG_OPS = {"aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy", "aten.log_"}
_VAR_OPS = {"aten.var", "aten.std", "aten.var_mean", "aten.std_mean"}
_MEAN_LOSS_OPS = {"aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.nll_loss", "aten.mean",
                  "aten.cross_entropy_loss"}
_SOFTMAX_OPS = {"aten._softmax", "aten.softmax", "aten._log_softmax", "aten.log_softmax",
                "aten._safe_softmax"}
_MATMUL_OPS = {"aten.addmm", "aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.baddbmm",
               "aten.convolution", "aten._convolution", "aten.mse_loss", "aten.pow", "aten.mul",
               "aten.exp", "aten.sum"}
_LOW_PRECISION = {"float16", "bfloat16"}


@dataclass(frozen=True)
class Facts:
    """What the localization established (inputs of :func:`likely_cause`).

    Attributes:
        phase: ``data`` | ``forward`` | ``backward`` | ``optimizer`` | ``none``.
        op: aten op of the birth; kind: ``nan`` | ``inf``.
        inputs / output: tensor statistics (``replay.trace.tensor_stats``) of the birth.
        node: autograd node name (backward).
        lr: the learning rate the step used, and lr_after: the one the scheduler set for the next.
        clip: the NaN was made by gradient clipping of an Inf gradient.
        eps_lost: the optimizer's eps rounds to 0 in the parameter dtype.
        zero_grad: the recipe zeroes gradients each step (False: a loop that forgot it).
        state_entry: the optimizer state entry at fault (e.g. ``exp_avg_sq``).
        recorded_nonfinite: for ``none``, the recorded run was non-finite at that step.
    """

    phase: str
    op: str | None = None
    kind: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] = field(default_factory=dict)
    node: str | None = None
    lr: float | None = None
    lr_after: float | None = None
    clip: bool = False
    eps_lost: bool = False
    zero_grad: bool = True
    state_entry: str | None = None
    recorded_nonfinite: bool = False


@dataclass(frozen=True)
class Cause:
    """A likely cause, its fix, and the row of the method's table it comes from."""

    cause: str
    fix: str
    row: str


def _finite(x: float | None) -> bool:
    return x is None or x == x and x not in (float("inf"), float("-inf"))


def _any_zero(inputs: list[dict[str, Any]]) -> bool:
    return any((s.get("zeros") or 0) > 0 for s in inputs)


def _any_negative(inputs: list[dict[str, Any]]) -> bool:
    return any(s.get("min") is not None and s["min"] < 0 for s in inputs)


def _biggest(inputs: list[dict[str, Any]]) -> float:
    return max([s.get("finite_max_abs") or 0.0 for s in inputs] + [0.0])


def likely_cause(f: Facts) -> Cause:
    """Return the likely :class:`Cause` for the facts of a verdict (rules in the table's spirit)."""
    if f.phase == "data":
        return Cause("the batch itself holds NaN/Inf (upstream data cleaning missed them)",
                     "clean the data; check inputs with torch.isnan(x).any() in the data pipeline",
                     ROWS["data"])
    if f.phase == "none":
        if f.recorded_nonfinite:
            return Cause("the recorded run was non-finite at this step but the replay is finite: the "
                         "step is not deterministic here (hardware, threads, or an RNG draw outside "
                         "the model)", "replay on the run's device; set deterministic flags in the "
                         "recipe", ROWS["none"])
        return Cause("the step re-ran with every value finite, as it did in the run",
                     "nothing to fix at this step; replay the incident step (without --step)", ROWS["none"])
    if not (_finite(f.lr) and _finite(f.lr_after)):
        return Cause("the learning-rate scheduler produced a non-finite learning rate (a division by "
                     "zero in the schedule)", "check the LambdaLR / warmup arguments (e.g. warmup_steps=0 "
                     "divides by zero) and ReduceLROnPlateau settings", ROWS["sched"])
    if f.clip:
        return Cause("gradient clipping turned an Inf gradient into NaN (total norm = inf, so the "
                     "clip coefficient is 0 and inf * 0 = NaN)", "clipping only masks the upstream "
                     "problem: fix the Inf gradient's origin (evidence.inf_gradient_origin), or skip "
                     "steps whose grad norm is non-finite as GradScaler does", ROWS["explode"])
    dtypes: set[str] = {s.get("dtype") for s in f.inputs} | {f.output.get("dtype")}  # type: ignore[assignment,arg-type]
    if f.phase == "optimizer":
        if f.eps_lost:
            return Cause(f"the optimizer's eps is 0 in {'/'.join(sorted(dtypes & _LOW_PRECISION)) or 'this dtype'} "
                         f"and {f.state_entry or 'the second moment'} is 0, so the update divides by zero",
                         "keep optimizer state in float32 (master weights, or torch.amp autocast + "
                         "GradScaler) or use an eps the dtype can hold (>= 1e-4 for float16)", ROWS["amp"])
        if f.op in _DIV_OPS and _any_zero(f.inputs):
            return Cause(f"division by zero in the optimizer step ({f.state_entry or 'a zero denominator'})",
                         "add a representable eps to the denominator; keep optimizer state in float32",
                         ROWS["div"])
        return Cause("the optimizer step made parameters non-finite (learning rate too large: the update "
                     "overflowed)", "lower the learning rate; find its range with an LR range test; "
                     "clip gradients", ROWS["lr"])
    if f.phase == "backward":
        if f.node and "AccumulateGrad" in f.node and not f.zero_grad:
            return Cause("gradients were summed across steps (zero_grad is never called) until they "
                         "overflowed" + (" float16" if "float16" in dtypes else ""),
                         "call optimizer.zero_grad() every step (or declare gradient accumulation with "
                         "a bounded number of micro-batches)", ROWS["zero_grad"])
        if f.op in _DIV_OPS and _any_zero(f.inputs) and f.node and any(
                k in f.node for k in ("Sqrt", "Norm", "Pow", "Rsqrt", "Div")):
            return Cause(f"the gradient of sqrt/norm at exactly 0 ({f.node}: 1 / (2 sqrt(0))) while "
                         "the forward value was finite", "add eps inside the sqrt (sqrt(x + eps)) or use "
                         "torch.linalg.vector_norm / F.normalize, whose gradient at 0 is 0", ROWS["div"])
        if f.op in _DIV_OPS and _any_zero(f.inputs):
            return Cause(f"division by zero in backward ({f.node or f.op})",
                         "add eps to the denominator in the forward formula", ROWS["div"])
        if f.op in _LOG_OPS or (f.node and "Log" in f.node):
            return Cause("the gradient of log at 0 (1/x) overflowed", "add eps inside the log",
                         ROWS["div"])
        if f.kind == "inf" and dtypes & _LOW_PRECISION and "float16" in dtypes:
            return Cause(f"a float16 gradient exceeded {FP16_MAX:g}", "use torch.amp GradScaler with "
                         "float32 master weights; clip gradients", ROWS["amp"])
        return Cause("gradient explosion: the chain rule multiplied large factors until a gradient "
                     "overflowed", "clip gradients with clip_grad_norm_, lower the learning rate, and "
                     "check recurrent weights / depth (e.g. truncate backprop through time)", ROWS["explode"])
    # forward
    if f.kind == "inf" and "float16" in dtypes and (f.output.get("posinf") or f.output.get("neginf")) \
            and f.op not in _LOG_OPS and f.op not in _DIV_OPS:
        return Cause(f"float16 overflow: a value exceeded {FP16_MAX:g}, the largest float16",
                     "let autocast run this op in float32 or rescale its inputs (normalize the data); "
                     "use GradScaler; check custom ops support fp16", ROWS["amp"])
    if f.op in _LOG_OPS and _any_zero(f.inputs):
        return Cause("log(0): a log of an exact zero (a probability or rate that reached 0: ReLU "
                     "output, or a sigmoid/softmax that saturated)", "add eps inside the log or compute "
                     "in log space (F.logsigmoid, log_softmax, BCEWithLogitsLoss, PoissonNLLLoss(log_input=True))",
                     ROWS["div"])
    if f.op in _LOG_OPS and _any_negative(f.inputs):
        return Cause("log of a negative number (the argument can cross 0, e.g. after added noise)",
                     "clamp the argument (x.clamp_min(eps)) or add the noise after the log", ROWS["div"])
    if f.op in _VAR_OPS and f.kind == "nan":
        return Cause("unbiased variance/std over a single element: it divides by N - 1 = 0",
                     "use unbiased=False (correction=0), or drop batches of size 1 (drop_last=True)",
                     ROWS["div"])
    if f.op in _SOFTMAX_OPS and f.kind == "nan":
        return Cause("softmax over a row where every position is -inf (fully masked): exp sums to 0",
                     "keep at least one unmasked position per row, drop empty sequences, or fill with "
                     "a large finite negative value instead of -inf", ROWS["div"])
    if f.op in _MEAN_LOSS_OPS and f.kind == "nan":
        return Cause("a mean over zero elements: every label is ignore_index (0 / 0)",
                     "skip batches with no valid label, or use reduction='sum' divided by max(1, valid count)",
                     ROWS["div"])
    if f.op in _DIV_OPS and _any_zero(f.inputs):
        return Cause("division by zero in forward (a zero denominator, e.g. a zero standard deviation "
                     "or a count of zero)", "add eps to the denominator (x / (std + eps)) or clamp the "
                     "count to >= 1; avoid degenerate samples in the data", ROWS["div"])
    if f.op in _MATMUL_OPS and _biggest(f.inputs) > 1e4:
        return Cause("values overflowed in forward because weights or activations grew huge (learning "
                     "rate too large: parameters diverged)", "lower the learning rate (LR range test); "
                     "add normalization and gradient clipping", ROWS["lr"])
    return Cause("an op produced a non-finite value from finite inputs",
                 "inspect the op's inputs in evidence; add eps / clamp where a denominator or log "
                 "argument can reach zero", ROWS["div"])
