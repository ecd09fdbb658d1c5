"""Tracing one forward pass and loss at the level of aten ops, and the custom autograd Functions met.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op below autograd with
its real input and output tensors, so "a softmax whose output flows into log_softmax" is a fact
read off the trace, not a guess from module names. Calls of ``torch.autograd.Function.apply`` are
recorded meanwhile (class and a detached copy of the arguments) for the gradcheck.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Op", "Trace", "trace_forward", "ACTIVATION_OPS"]

#: Ops whose outputs the dead/saturated-unit check looks at.
ACTIVATION_OPS = ("relu", "relu_", "hardtanh", "hardtanh_", "sigmoid", "tanh")


@dataclass
class Op:
    """One aten op of the trace.

    Attributes:
        name: the overload packet's name (``_softmax``, ``nll_loss_forward``, ``mse_loss``...).
        inputs / outputs: ids of the tensors it read / wrote (valid while the Trace is alive).
        in_shapes / out_shapes: their shapes.
        phase: ``"model"`` while the model's forward runs, ``"loss"`` after it returned.
    """

    name: str
    inputs: list[int]
    outputs: list[int]
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    phase: str


@dataclass
class Trace:
    """What one forward + loss did.

    Attributes:
        ops: aten ops in order.
        tensors: id -> tensor for every op output (kept alive so ids stay unique).
        functions: custom ``autograd.Function`` classes met -> (args, kwargs) of their first call,
            tensors detached and cloned.
        loss: the loss tensor ``loss_fn`` returned (attached to the graph).
        error: what ``loss_fn`` raised, None when it returned; the ops up to the raising one are kept.
        module_shapes: (module name, type, output shape(s)) per module call, in call order.
        activations: (op name, phase, detached copy of the output) of every ReLU-like, sigmoid
            and tanh op (:data:`ACTIVATION_OPS`), copied because a later in-place op may change it.
    """

    ops: list[Op] = field(default_factory=list)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    functions: dict[type, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    error: Exception | None = None
    module_shapes: list[tuple[str, str, str]] = field(default_factory=list)
    activations: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace
        self.phase = "model"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's API
        name = func.overloadpacket.__name__
        if name == "detach":  # autograd bookkeeping, not the user's computation
            return func(*args, **(kwargs or {}))
        ins = _tensors((args, kwargs))
        # Noted before it runs: an op that raises (nll_loss on an out-of-range label) stays in
        # the trace, so the labels check still learns the loss kind and C.
        op = Op(name, [id(t) for t in ins], [], [tuple(t.shape) for t in ins], [], self.phase)
        self.trace.ops.append(op)
        out = func(*args, **(kwargs or {}))
        outs = _tensors(out)
        for t in outs:
            self.trace.tensors[id(t)] = t
        op.outputs, op.out_shapes = [id(t) for t in outs], [tuple(t.shape) for t in outs]
        if name in ACTIVATION_OPS and outs:
            self.trace.activations.append((name, self.phase, outs[0].detach().clone()))
        return out


def _clone_arg(a: Any) -> Any:
    return a.detach().clone() if isinstance(a, torch.Tensor) else a


@contextlib.contextmanager
def _record_functions(trace: Trace) -> Iterator[None]:
    """Patch ``Function.apply`` to note each custom Function's class and first arguments."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls not in trace.functions and cls.__module__.split(".")[0] != "torch":
            trace.functions[cls] = (tuple(_clone_arg(a) for a in args),
                                    {k: _clone_arg(v) for k, v in kwargs.items()})
        return original.__func__(cls, *args, **kwargs)

    # A classmethod swapped in on the class for the trace's duration (mypy: methods are read-only).
    base.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        base.apply = original  # type: ignore[method-assign]


def trace_forward(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                  batch: Any) -> Trace:
    """Run ``loss_fn(model, batch)`` once under the recorder and return the :class:`Trace`.

    Ops run after the model's top-level forward returned are marked ``phase="loss"`` (a
    forward hook flips the phase), so a loss-side broadcast is told from the model's own.

    Never raises: an exception of ``loss_fn`` is stored in ``Trace.error``.
    """
    trace = Trace()
    rec = _Recorder(trace)

    def to_loss(_mod: Any, _inp: Any, _out: Any) -> None:
        rec.phase = "loss"

    def to_model(_mod: Any, _inp: Any) -> None:
        rec.phase = "model"

    handles = [model.register_forward_pre_hook(to_model)]
    for name, mod in model.named_modules():
        if mod is not model:
            handles.append(mod.register_forward_hook(_shape_hook(trace, name)))
    handles.append(model.register_forward_hook(_shape_hook(trace, "(model)")))
    handles.append(model.register_forward_hook(to_loss))
    try:
        with _record_functions(trace), rec:
            trace.loss = loss_fn(model, batch)
    except Exception as exc:  # noqa: BLE001 - the user's code; reported by the checks
        trace.error = exc
    finally:
        for h in handles:
            h.remove()
    return trace


def _shape_hook(trace: Trace, name: str) -> Callable[..., None]:
    def hook(mod: torch.nn.Module, _inp: Any, out: Any) -> None:
        shapes = [list(t.shape) for t in _tensors(out)]
        text = " ".join(str(s) for s in shapes) if shapes else type(out).__name__
        trace.module_shapes.append((name, type(mod).__name__, text))
    return hook
