"""Changes at one op or one module for the counterfactual engine: an eps or clamp at the culprit
op, a ``log1p``/``softplus``-style rewrite of it, and a module run in float32 with autocast off.

The culprit is named by the localizer's dispatch tracing (``replay.trace``: an aten op such as
``aten.log`` inside module ``enc.2``). The guard wraps that op's call sites inside that module
(anywhere when the module is null: the loss function) with a ``TorchFunctionMode``, one level
above autograd rather than in the dispatcher below it: a guard in the dispatcher would change the
forward value while autograd's saved input, and so the backward (``1/x`` for ``log``), stayed the
unguarded one. Here the clamp is part of the graph and its gradient is the clamp's.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["OpGuard", "op_guard", "fp32_module", "base_name", "GUARDABLE", "REWRITABLE"]

#: Ops an eps (lower bound on the input) makes finite: their domain ends at 0.
_EPS_OPS = frozenset({"log", "log2", "log10", "sqrt", "rsqrt", "reciprocal", "pow"})
#: Ops whose denominator an eps keeps away from 0.
_DIV_OPS = frozenset({"div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__"})
#: Ops a clamp of the input into their domain / range makes finite.
_CLAMP_OPS = frozenset({"acos", "asin", "atanh", "exp", "expm1", "log1p"})
#: Python operators -> the op they call.
_DUNDER = {"__pow__": "pow", "__ipow__": "pow"}
#: Culprit ops (aten base names) a guard applies to.
GUARDABLE = _EPS_OPS | {"div"} | _CLAMP_OPS
#: Culprit ops with a numerically stable rewrite when their input has the right producer.
REWRITABLE = frozenset({"log"})
#: Ops that pick, drop or move elements without changing their values, so an elementwise ``log``
#: commutes with them: ``log(p.gather(1, y))`` is ``log_softmax(z).gather(1, y)`` when
#: ``p = softmax(z)``. A hand-written NLL (softmax, pick the label's column, log) puts them between
#: the producer and the log; without them the rewrite found no producer and changed nothing.
_CARRY = frozenset({"gather", "take_along_dim", "index_select", "masked_select", "__getitem__",
                    "select", "narrow", "squeeze", "unsqueeze", "view", "reshape", "flatten",
                    "transpose", "t", "permute", "expand", "contiguous", "clone"})


def base_name(op: str | None) -> str | None:
    """``aten.log.default`` / ``aten.log_`` / ``log`` -> ``log``; None stays None."""
    if not op:
        return None
    parts = str(op).split(".")
    name = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    return name.rstrip("_") if not name.startswith("__") else name


@dataclass(frozen=True)
class OpGuard:
    """An eps, a clamp or a rewrite at one op.

    Attributes:
        op: the culprit op, aten name or base name (``aten.log``, ``log``).
        module: qualified module name the op runs in, or None for anywhere (outside the model).
        mode: ``"eps"`` (input >= eps; a denominator |x| >= eps), ``"clamp"`` (input into the op's
            domain: [-1+eps, 1-eps] for acos/asin/atanh, <= log(max) for exp) or ``"rewrite"``
            (``log(sigmoid(z))`` -> ``logsigmoid(z)``, ``log(softmax(z))`` -> ``log_softmax(z)``,
            ``log(1 + exp(z))`` -> ``softplus(z)``, ``log(1 + x)`` -> ``log1p(x)``).
        eps: the bound; None: 1e-12 (or the dtype's smallest normal if larger, e.g. float16).
    """

    op: str
    module: str | None = None
    mode: str = "eps"
    eps: float | None = None


def _eps(t: torch.Tensor, eps: float | None) -> float:
    return eps if eps is not None else max(1e-12, float(torch.finfo(t.dtype).tiny))


class _Guard(TorchFunctionMode):
    def __init__(self, guard: OpGuard, inside: list[int]) -> None:
        super().__init__()
        self.guard, self.inside = guard, inside
        self.name = base_name(guard.op)
        self.applied = 0
        #: calls of the op where the guard looks, changed or not: ``applied == 0 < calls`` says
        #: the op ran there but no call site could be changed (a rewrite found no producer).
        self.calls = 0
        #: what each applied rewrite became (``log_softmax``, ...), in call order
        self.rewrites: list[str] = []
        # id(output) -> (weakref to it, producer name, producer input, dim, carried ops): for
        # rewrites; the carried ops (:data:`_CARRY`, with their other arguments) ran on the
        # producer's output before the log and are replayed on the rewrite's output.
        self.made: dict[int, tuple[Any, str, Any, Any, tuple[Any, ...]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        fname = getattr(func, "__name__", "")
        active = self.guard.module is None or self.inside[0] > 0
        if not active:
            return func(*args, **kwargs)
        name = fname.rstrip("_") if not fname.startswith("__") else _DUNDER.get(fname, fname)
        g = self.guard
        if name == self.name or (self.name == "div" and name in _DIV_OPS):
            self.calls += 1
        if g.mode == "rewrite":
            if args and isinstance(args[0], torch.Tensor) and name != "log" and (
                    fname == "__setitem__" or fname.startswith("__i")
                    or (fname.endswith("_") and not fname.startswith("__"))):
                # changed in place: it no longer holds what its producer made
                self.made.pop(id(args[0]), None)
            return self._rewrite(func, name, args, kwargs)
        if name == self.name or (self.name == "div" and name in _DIV_OPS):
            args = list(args)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                self.applied += 1
                if name in _DIV_OPS:
                    i = 0 if name == "__rtruediv__" else 1
                    d = args[i] if len(args) > i else kwargs.get("other")
                    if isinstance(d, torch.Tensor) and d.is_floating_point():
                        e = _eps(d, g.eps)
                        args[i] = torch.where(d >= 0, d.clamp_min(e), d.clamp_max(-e))
                elif name in ("acos", "asin", "atanh"):
                    e = g.eps if g.eps is not None else 1e-6
                    args[0] = x.clamp(-1 + e, 1 - e)
                elif name in ("exp", "expm1"):
                    args[0] = x.clamp_max(float(torch.log(torch.tensor(torch.finfo(x.dtype).max))) - 1)
                elif name == "log1p":
                    args[0] = x.clamp_min(-1 + _eps(x, g.eps))
                else:
                    args[0] = x.clamp_min(_eps(x, g.eps))
            return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _rewrite(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        if name == "log" and args and isinstance(args[0], torch.Tensor):
            made = self.made.get(id(args[0]))
            if made is not None and made[0]() is args[0]:
                _ref, producer, z, dim, carried = made
                self.applied += 1
                self.rewrites.append(_STABLE[producer])
                if producer == "sigmoid":
                    out = F.logsigmoid(z)
                elif producer == "softmax":
                    out = F.log_softmax(z, dim=dim)
                elif producer == "1+exp":
                    out = F.softplus(z)
                else:  # "1+x"
                    out = torch.log1p(z)
                for f, rest, kw in carried:
                    out = f(out, *rest, **kw)
                return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and args:
            x = args[0]
            prev = self.made.get(id(x)) if isinstance(x, torch.Tensor) else None
            if name in _CARRY and prev is not None and prev[0]() is x and prev[1] != "exp":
                self._note(out, prev[1], prev[2], prev[3], (*prev[4], (func, tuple(args[1:]), kwargs)))
                return out
            if name == "sigmoid" and isinstance(x, torch.Tensor):
                self._note(out, "sigmoid", x, None)
            elif name == "softmax" and isinstance(x, torch.Tensor):
                self._note(out, "softmax", x, kwargs.get("dim", args[1] if len(args) > 1 else None))
            elif name in ("exp",) and isinstance(x, torch.Tensor):
                self._note(out, "exp", x, None)
            elif name in ("add", "__add__", "__radd__") and len(args) == 2:
                t, c = (args[0], args[1]) if isinstance(args[0], torch.Tensor) else (args[1], args[0])
                if isinstance(t, torch.Tensor) and isinstance(c, (int, float)) and c == 1:
                    prev = self.made.get(id(t))
                    if prev is not None and prev[0]() is t and prev[1] == "exp" and not prev[4]:
                        self._note(out, "1+exp", prev[2], None)
                    else:
                        self._note(out, "1+x", t, None)
        return out

    def _note(self, out: torch.Tensor, producer: str, z: Any, dim: Any, carried: tuple[Any, ...] = ()) -> None:
        if len(self.made) > 4096:  # outputs of earlier steps: forget the collected ones
            self.made = {k: v for k, v in self.made.items() if v[0]() is not None}
        self.made[id(out)] = (weakref.ref(out), producer, z, dim, carried)


#: The stable op each producer's ``log`` becomes.
_STABLE = {"sigmoid": "logsigmoid", "softmax": "log_softmax", "1+exp": "softplus", "1+x": "log1p"}


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    for n, m in model.named_modules():
        if n == name:
            return m
    raise ValueError(f"no module {name!r} in the model")


@contextlib.contextmanager
def op_guard(model: torch.nn.Module, guard: OpGuard) -> Iterator[_Guard]:
    """While active, ``guard`` applies to its op inside ``guard.module`` (anywhere if None).

    Raises:
        ValueError: the module is not in the model.
    """
    inside = [0]
    handles = []
    if guard.module is not None:
        m = _module(model, guard.module)

        def pre(*_a: Any) -> None:
            inside[0] += 1

        def post(*_a: Any) -> None:
            inside[0] -= 1
        handles = [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    mode = _Guard(guard, inside)
    try:
        with mode:
            yield mode
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def fp32_module(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Module ``name`` runs with autocast off and its floating inputs in float32 (its float16 /
    bfloat16 parameters cast to float32 for the run); its output keeps float32.

    Raises:
        ValueError: the module is not in the model.
    """
    m = _module(model, name)
    for p in m.parameters(recurse=True):
        if p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    orig = m.forward
    device = next((p.device.type for p in model.parameters()), "cpu")

    def forward(*args: Any, **kwargs: Any) -> Any:
        cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        kw = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
        with torch.autocast(device, enabled=False):
            return orig(*cast, **kw)
    m.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del m.forward
