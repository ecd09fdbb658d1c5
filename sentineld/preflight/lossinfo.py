"""Reading the loss off a :class:`~.trace.Trace`: which kind, over how many classes, on what input."""

from __future__ import annotations

from dataclasses import dataclass

from .trace import Op, Trace

__all__ = ["LossInfo", "loss_info", "producer_of"]

_CE_OPS = ("nll_loss_forward", "nll_loss2d_forward")
_BCE_OPS = ("binary_cross_entropy_with_logits", "binary_cross_entropy")
_REG_OPS = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")


@dataclass(frozen=True)
class LossInfo:
    """The loss the trace ended in.

    Attributes:
        kind: ``"ce"`` (nll_loss; CrossEntropyLoss is log_softmax + nll_loss at the aten level),
            ``"bce"``, ``"regression"``, ``"other"``, or ``"unknown"`` when the forward raised.
        op: the loss op, or None for ``"other"``.
        num_classes: the class dimension of the nll_loss input (dim 1, or the last dim of 2-D
            input), None otherwise.
    """

    kind: str
    op: Op | None
    num_classes: int | None


def loss_info(trace: Trace) -> LossInfo:
    """The last loss op of the trace's loss phase (or of the whole trace) and what it says."""
    for op in reversed(trace.ops):
        if op.name in _CE_OPS:
            shape = op.in_shapes[0]
            c = shape[1] if len(shape) >= 2 else (shape[0] if shape else None)
            return LossInfo("ce", op, c)
        if op.name in _BCE_OPS:
            return LossInfo("bce", op, None)
        if op.name in _REG_OPS:
            return LossInfo("regression", op, None)
    last = trace.ops[-1] if trace.ops else None
    if trace.error is not None and last is not None and last.name == "_log_softmax":
        # cross_entropy validates its target after log_softmax and before nll_loss: a float or
        # mis-shaped target raises right there.
        shape = last.in_shapes[0]
        return LossInfo("ce", last, shape[1] if len(shape) >= 2 else None)
    return LossInfo("unknown" if trace.error is not None else "other", None, None)


def producer_of(trace: Trace, tensor_id: int, before: int) -> tuple[int, Op] | None:
    """The last op before index ``before`` that wrote ``tensor_id``, with its index."""
    for i in range(before - 1, -1, -1):
        if tensor_id in trace.ops[i].outputs:
            return i, trace.ops[i]
    return None
