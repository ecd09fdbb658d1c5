"""Likely cause and fix of a localized non-finite value, from the method's NaN/Inf table.

Source: ``debugging-and-diagnosis.txt``, "NaN / Inf Troubleshooting", whose rows are (in the
method's order of likelihood) learning rate too large, division by zero / log(0), gradient
explosion, mixed precision (AMP) overflow (float16's largest value is 65504), data containing NaN,
learning-rate scheduler division by zero; plus the "Common Bug List" row "forgot
optimizer.zero_grad()", "Hand-coded gradient errors" (use gradcheck) and "Wrong indexing/slicing
causes mask misalignment". Each verdict names the row it comes from and a cause class
(:data:`sentineld.contracts.verdict.CAUSE_CLASSES`), decided from what was seen: the phase, the
forward op and the primitive that made the value, the autograd node (a custom Function's or not),
whether torch.where took the op's output, NaN or Inf, and the inputs' ranges. The wording follows
the forward op (a user who wrote ``x ** p`` is not told to add eps inside a log). Pure functions
over :class:`Facts`; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sentineld.contracts.verdict import CAUSE_CLASSES

from .singular import singular_point

__all__ = ["Facts", "Cause", "likely_cause", "FP16_MAX", "ROWS", "CAUSE_CLASSES"]

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
    "gradcheck": "Hand-coded gradient errors: use gradcheck (common bug list)",
    "mask": "Wrong indexing/slicing causes mask misalignment (common bug list)",
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
#: Primitives whose Inf in backward is growth through the chain rule (products and sums).
_PRODUCT_OPS = _MATMUL_OPS - {"aten.exp", "aten.pow"} | {"aten.add", "aten.add_", "aten.addcmul",
                                                         "aten.convolution_backward", "aten.mul_"}
_DOMAIN_OPS = {"aten.sqrt", "aten.acos", "aten.asin", "aten.pow", "aten.atanh", "aten.acosh"}
_LOW_PRECISION = {"float16", "bfloat16"}



@dataclass(frozen=True)
class Facts:
    """What the localization established (inputs of :func:`likely_cause`).

    Attributes:
        phase: ``data`` | ``forward`` | ``backward`` | ``optimizer`` | ``none``.
        op: aten op of the birth (in backward: the primitive inside the derivative, e.g.
            ``aten.rsqrt``); kind: ``nan`` | ``inf``.
        inputs / output: tensor statistics (``replay.trace.tensor_stats``) of the birth.
        node: autograd node name (backward).
        forward_op: in backward, the forward op whose derivative made it (``aten.acos``) or a
            custom autograd Function's class name.
        custom_function: in backward, the custom autograd Function whose backward made it.
        where_branch: in backward, the node's forward output was taken by torch.where / masked_fill.
        masked_forward: no birth in backward: the forward made the value in elements a selector
            then dropped (its gradient still flows through them).
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
    forward_op: str | None = None
    custom_function: str | None = None
    where_branch: bool = False
    masked_forward: bool = False
    lr: float | None = None
    lr_after: float | None = None
    clip: bool = False
    eps_lost: bool = False
    zero_grad: bool = True
    state_entry: str | None = None
    recorded_nonfinite: bool = False


@dataclass(frozen=True)
class Cause:
    """A likely cause: its class (:data:`CAUSE_CLASSES`), text, fix, and the method's table row."""

    cls: str
    cause: str
    fix: str
    row: str

    def __post_init__(self) -> None:
        if self.cls not in CAUSE_CLASSES:
            raise ValueError(f"cause class {self.cls!r} is not in CAUSE_CLASSES")


def _finite(x: float | None) -> bool:
    return x is None or x == x and x not in (float("inf"), float("-inf"))


def _any_zero(inputs: list[dict[str, Any]]) -> bool:
    return any((s.get("zeros") or 0) > 0 for s in inputs)


def _any_negative(inputs: list[dict[str, Any]]) -> bool:
    return any(s.get("min") is not None and s["min"] < 0 for s in inputs)


def _biggest(inputs: list[dict[str, Any]]) -> float:
    return max([s.get("finite_max_abs") or 0.0 for s in inputs] + [0.0])


def _short(op: str | None) -> str:
    return (op or "the op").removeprefix("aten.")


def likely_cause(f: Facts) -> Cause:
    """Return the likely :class:`Cause` for the facts of a verdict (rules in the table's spirit)."""
    if f.phase == "data":
        return Cause("data_nonfinite", "the batch itself holds NaN/Inf (upstream data cleaning missed them)",
                     "clean the data; check inputs with torch.isnan(x).any() in the data pipeline",
                     ROWS["data"])
    if f.phase == "none":
        if f.recorded_nonfinite:
            return Cause("nondeterministic", "the recorded run was non-finite at this step but the replay "
                         "is finite: the step is not deterministic here (hardware, threads, or an RNG draw "
                         "outside the model)", "replay on the run's device; set deterministic flags in the "
                         "recipe", ROWS["none"])
        return Cause("finite", "the step re-ran with every value finite, as it did in the run",
                     "nothing to fix at this step; replay the incident step (without --step)", ROWS["none"])
    if not (_finite(f.lr) and _finite(f.lr_after)):
        return Cause("lr_schedule", "the learning-rate scheduler produced a non-finite learning rate (a "
                     "division by zero in the schedule)", "check the LambdaLR / warmup arguments (e.g. "
                     "warmup_steps=0 divides by zero) and ReduceLROnPlateau settings", ROWS["sched"])
    if f.clip:
        return Cause("clip_of_inf", "gradient clipping turned an Inf gradient into NaN (total norm = inf, "
                     "so the clip coefficient is 0 and inf * 0 = NaN)", "clipping only masks the upstream "
                     "problem: fix the Inf gradient's origin (evidence.inf_gradient_origin), or skip "
                     "steps whose grad norm is non-finite as GradScaler does", ROWS["explode"])
    if f.phase == "optimizer":
        return _optimizer_cause(f)
    if f.phase == "backward":
        return _backward_cause(f)
    return _forward_cause(f)


def _dtypes(f: Facts) -> set[str]:
    return {str(s.get("dtype")) for s in f.inputs} | {str(f.output.get("dtype"))}


def _optimizer_cause(f: Facts) -> Cause:
    dtypes = _dtypes(f)
    if f.eps_lost:
        return Cause("optimizer_eps_lost", f"the optimizer's eps is 0 in "
                     f"{'/'.join(sorted(dtypes & _LOW_PRECISION)) or 'this dtype'} and "
                     f"{f.state_entry or 'the second moment'} is 0, so the update divides by zero",
                     "keep optimizer state in float32 (master weights, or torch.amp autocast + "
                     "GradScaler) or use an eps the dtype can hold (>= 1e-4 for float16)", ROWS["amp"])
    if f.op in _DIV_OPS and _any_zero(f.inputs):
        return Cause("optimizer_div_zero", f"division by zero in the optimizer step "
                     f"({f.state_entry or 'a zero denominator'})",
                     "add a representable eps to the denominator; keep optimizer state in float32", ROWS["div"])
    return Cause("lr_too_high", "the optimizer step made parameters non-finite (learning rate too large: "
                 "the update overflowed)", "lower the learning rate; find its range with an LR range test; "
                 "clip gradients", ROWS["lr"])


def _backward_cause(f: Facts) -> Cause:
    """Backward: the class follows the node (custom Function, AccumulateGrad), where torch.where took
    the forward output, and the forward op's singular point; clipping is advised only for growth."""
    dtypes, fwd = _dtypes(f), f.forward_op
    if f.node and "AccumulateGrad" in f.node and not f.zero_grad:
        return Cause("grad_accumulated", "gradients were summed across steps (zero_grad is never called) "
                     "until they overflowed" + (" float16" if "float16" in dtypes else ""),
                     "call optimizer.zero_grad() every step (or declare gradient accumulation with "
                     "a bounded number of micro-batches)", ROWS["zero_grad"])
    if f.custom_function:
        return Cause("custom_backward", f"the hand-written backward of the custom autograd Function "
                     f"{f.custom_function} made {f.kind or 'a non-finite value'} in {_short(f.op)} (inputs up "
                     f"to {_biggest(f.inputs):.4g}) while its forward was finite",
                     f"rewrite {f.custom_function}.backward in a numerically stable form (reuse the outputs "
                     "saved in forward, compute in log space, e.g. torch.sigmoid(x) instead of exp(x) / "
                     "(1 + exp(x))) and check it with torch.autograd.gradcheck in float64; clipping "
                     "gradients cannot help: the value is made inside the formula", ROWS["gradcheck"])
    sing = singular_point(fwd)
    if f.masked_forward or (f.where_branch and f.kind == "nan"):
        at = f" at {sing.point}" if sing else ""
        return Cause("where_masked_branch", f"{_short(fwd)} is computed for every element, and "
                     "torch.where / masked_fill then drops some of them; in backward they get a zero "
                     f"gradient, and 0 times {_short(fwd)}'s infinite derivative{at} (0/0) is NaN, so the "
                     "discarded elements poison the gradient", f"mask the input before {_short(fwd)}, not "
                     f"only its output: y = torch.where(mask, x, safe_value); out = torch.where(mask, "
                     f"{_short(fwd)}(y), 0)", ROWS["mask"])
    if sing is not None and (_any_zero(f.inputs) or f.kind == "inf" or (f.op in _LOG_OPS | _DIV_OPS)):
        return Cause("grad_at_singularity", f"{_short(fwd)} was finite in forward but its derivative is "
                     f"infinite at {sing.point} ({sing.derivative}), and an input sat exactly there "
                     f"({f.node or fwd})", sing.fix, ROWS["div"])
    if f.op in _DIV_OPS and _any_zero(f.inputs):
        return Cause("div_zero", f"division by zero in the backward of {_short(fwd)} ({f.node or f.op})",
                     "add eps to the denominator in the forward formula", ROWS["div"])
    if f.kind == "inf" and "float16" in dtypes:
        return Cause("fp16_overflow", f"a float16 gradient exceeded {FP16_MAX:g}", "use torch.amp GradScaler "
                     "with float32 master weights; clip gradients", ROWS["amp"])
    if f.kind == "inf" and f.op in _PRODUCT_OPS:
        return Cause("grad_explosion", "gradient explosion: the chain rule multiplied large factors until "
                     f"a gradient overflowed in the backward of {_short(fwd)}", "clip gradients with "
                     "clip_grad_norm_, lower the learning rate, and check recurrent weights / depth (e.g. "
                     "truncate backprop through time)", ROWS["explode"])
    return Cause("unknown", f"the backward of {_short(fwd)} made {f.kind or 'a non-finite value'} in "
                 f"{_short(f.op)} from finite values ({f.node or 'no autograd node'})",
                 f"inspect evidence.op_inputs; check {_short(fwd)}'s inputs for values where its "
                 "derivative is not finite", ROWS["div"])


def _forward_cause(f: Facts) -> Cause:
    dtypes = _dtypes(f)
    if f.kind == "inf" and "float16" in dtypes and (f.output.get("posinf") or f.output.get("neginf")) \
            and f.op not in _LOG_OPS and f.op not in _DIV_OPS:
        return Cause("fp16_overflow", f"float16 overflow: a value exceeded {FP16_MAX:g}, the largest float16",
                     "let autocast run this op in float32 or rescale its inputs (normalize the data); "
                     "use GradScaler; check custom ops support fp16", ROWS["amp"])
    if f.op in _LOG_OPS and _any_zero(f.inputs):
        return Cause("log_zero", "log(0): a log of an exact zero (a probability or rate that reached 0: ReLU "
                     "output, or a sigmoid/softmax that saturated)", "add eps inside the log or compute "
                     "in log space (F.logsigmoid, log_softmax, BCEWithLogitsLoss, PoissonNLLLoss(log_input=True))",
                     ROWS["div"])
    if f.op in _LOG_OPS and _any_negative(f.inputs):
        return Cause("domain_error", "log of a negative number (the argument can cross 0, e.g. after added "
                     "noise)", "clamp the argument (x.clamp_min(eps)) or add the noise after the log", ROWS["div"])
    if f.op in _DOMAIN_OPS and f.kind == "nan" and (_any_negative(f.inputs) or _biggest(f.inputs) > 1):
        return Cause("domain_error", f"{_short(f.op)} of a value outside its domain (a negative base or "
                     "argument, or |x| > 1 for acos/asin)", "clamp the argument into the op's domain "
                     "before it", ROWS["div"])
    if f.op in _VAR_OPS and f.kind == "nan":
        return Cause("var_one_element", "unbiased variance/std over a single element: it divides by N - 1 = 0",
                     "use unbiased=False (correction=0), or drop batches of size 1 (drop_last=True)", ROWS["div"])
    if f.op in _SOFTMAX_OPS and f.kind == "nan":
        return Cause("softmax_all_masked", "softmax over a row where every position is -inf (fully masked): "
                     "exp sums to 0", "keep at least one unmasked position per row, drop empty sequences, "
                     "or fill with a large finite negative value instead of -inf", ROWS["div"])
    if f.op in _MEAN_LOSS_OPS and f.kind == "nan":
        return Cause("mean_empty", "a mean over zero elements: every label is ignore_index (0 / 0)",
                     "skip batches with no valid label, or use reduction='sum' divided by max(1, valid count)",
                     ROWS["div"])
    if f.op in _DIV_OPS and _any_zero(f.inputs):
        return Cause("div_zero", "division by zero in forward (a zero denominator, e.g. a zero standard "
                     "deviation or a count of zero)", "add eps to the denominator (x / (std + eps)) or clamp "
                     "the count to >= 1; avoid degenerate samples in the data", ROWS["div"])
    if f.op in _MATMUL_OPS and _biggest(f.inputs) > 1e4:
        return Cause("lr_too_high", "values overflowed in forward because weights or activations grew huge "
                     "(learning rate too large: parameters diverged)", "lower the learning rate (LR range "
                     "test); add normalization and gradient clipping", ROWS["lr"])
    return Cause("unknown", "an op produced a non-finite value from finite inputs",
                 "inspect the op's inputs in evidence; add eps / clamp where a denominator or log "
                 "argument can reach zero", ROWS["div"])
