"""Instrumentation for one replayed step: where was the first non-finite value *born*?

A value is born non-finite by an op when
- its output holds NaN while no tensor input and no scalar argument held NaN, or
- its output holds +-Inf while every tensor input and scalar argument was finite.

So ``masked_fill(x, mask, -inf)`` (a non-finite scalar argument) is not a birth, ``softmax`` of a
fully masked row (NaN from -inf inputs) is, and ``log(0)`` is. Every aten op is observed through a
``TorchDispatchMode`` (forward, backward and optimizer alike; the autograd engine carries the mode
into backward); a ``TorchFunctionMode`` remembers which module created each autograd node, so a
birth inside backward is traced to its module through ``torch._C._current_autograd_node()``.
Module forward hooks keep the module stack and record the first module whose output is non-finite
while its inputs are finite (issue 2's definition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Birth", "ModuleBirth", "Tracer", "tensor_stats"]

# Factory ops return uninitialised memory that may hold NaN bit patterns by chance.
_SKIP_PREFIXES = ("aten.empty", "aten.new_empty", "aten._to_copy", "aten.set_", "aten.detach",
                  "aten.lift_fresh", "aten.alias", "aten.resize_")


def _float_tensors(objs: Iterable[Any]) -> list[torch.Tensor]:
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()) and o.numel():
            out.append(o)
    return out


def _has_nan(ts: list[torch.Tensor]) -> bool:
    return any(bool(torch.isnan(t).any()) for t in ts)


def _has_inf(ts: list[torch.Tensor]) -> bool:
    return any(bool(torch.isinf(t).any()) for t in ts)


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Evidence for one tensor: dtype, shape, min/max/max|x| over finite values, counts.

    Returns a JSON-ready dict; ``finite_max_abs`` is None when nothing is finite.
    """
    t = t.detach()
    stats: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return stats
    f = t.float() if not t.is_complex() else t.abs().float()
    finite = torch.isfinite(f)
    vals = f[finite]
    stats.update(
        numel=int(t.numel()),
        nan=int(torch.isnan(f).sum()),
        posinf=int((f == math.inf).sum()),
        neginf=int((f == -math.inf).sum()),
        zeros=int((f == 0).sum()),
        min=float(vals.min()) if vals.numel() else None,
        max=float(vals.max()) if vals.numel() else None,
        finite_max_abs=float(vals.abs().max()) if vals.numel() else None,
    )
    return stats


@dataclass
class Birth:
    """One op that produced a non-finite value from values that were not.

    Attributes:
        index: execution order among all observed ops of the step.
        phase: ``forward`` | ``backward`` | ``clip`` | ``optimizer`` | ``scheduler``.
        kind: ``nan`` or ``inf``.
        op: aten op name, e.g. ``aten.log`` (overload dropped).
        module: qualified module name (``named_modules()``), ``None`` outside any module.
        module_type: class name of that module.
        autograd_node: in backward, the autograd node's name (e.g. ``SqrtBackward0``).
        inputs, output: :func:`tensor_stats` of the op's tensor inputs and first output.
        scalars: non-tensor numeric arguments.
        tensor_names: names of parameters / optimizer state among the inputs (optimizer phase).
    """

    index: int
    phase: str
    kind: str
    op: str
    module: str | None
    module_type: str | None
    autograd_node: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] = field(default_factory=dict)
    scalars: list[float] = field(default_factory=list)
    tensor_names: list[str] = field(default_factory=list)


@dataclass
class ModuleBirth:
    """First module whose forward output is non-finite while all its inputs are finite."""

    module: str
    module_type: str
    inputs: list[dict[str, Any]]
    output: dict[str, Any]


class _Dispatch(TorchDispatchMode):
    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tr = self.tracer
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        name = name if name.startswith("aten.") else f"aten.{name}"
        leaves, _ = tree_flatten((args, kwargs))
        skip = name.startswith(_SKIP_PREFIXES) or not tr.active
        ins = [] if skip else _float_tensors(leaves)
        scalars = [float(x) for x in leaves if isinstance(x, float)]
        in_nan = (not skip) and (_has_nan(ins) or any(math.isnan(s) for s in scalars))
        in_inf = (not skip) and (_has_inf(ins) or any(math.isinf(s) for s in scalars))
        in_stats = [tensor_stats(t) for t in ins[:4]] if not skip and (tr.wants_birth) else []
        out = func(*args, **kwargs)
        if skip:
            return out
        tr.op_count += 1
        if not tr.wants_birth:
            return out
        outs = _float_tensors(tree_flatten(out)[0])
        if not outs:
            return out
        kind = None
        if not in_nan and _has_nan(outs):
            kind = "nan"
        elif not in_nan and not in_inf and _has_inf(outs):
            kind = "inf"
        if kind is not None:
            tr.record_birth(kind, name, ins, in_stats, outs[0], scalars)
        return out


class _Function(TorchFunctionMode):
    """Remember which module (and torch function) created each autograd node."""

    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tr = self.tracer
        if tr.phase == "forward" and tr.stack:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    key = id(t.grad_fn)
                    if key not in tr.node_module:
                        tr.node_module[key] = (tr.stack[-1], t.grad_fn)
        return out


class Tracer:
    """Observe one step; ``births`` holds every birth in execution order.

    Use as a context manager around the step; call :meth:`set_phase` as phases change (it is
    passed to :func:`sentineld.recipe.train_step` as ``on_phase``).

    Args:
        model: the model whose modules are named in the report.
        tensor_names: ``data_ptr -> name`` for parameters and optimizer state (optimizer phase).
        max_births: stop recording after this many births (the first ones are what matter).
    """

    def __init__(self, model: torch.nn.Module, tensor_names: dict[int, str] | None = None,
                 max_births: int = 64) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.types = {id(m): type(m).__name__ for _, m in model.named_modules()}
        self.tensor_names = tensor_names or {}
        self.max_births = max_births
        self.phase = "forward"
        self.stack: list[str] = []
        self.births: list[Birth] = []
        self.module_birth: ModuleBirth | None = None
        self.node_module: dict[int, tuple[str, Any]] = {}
        self.op_count = 0
        self.active = True
        self._handles: list[Any] = []
        self._modes: list[Any] = []

    @property
    def wants_birth(self) -> bool:
        return len(self.births) < self.max_births

    def set_phase(self, phase: str) -> None:
        """Mark the start of ``phase`` (see :data:`sentineld.recipe.PHASES`)."""
        self.phase = phase

    def _module_name(self, m: torch.nn.Module) -> str:
        return self.names.get(id(m)) or f"<{type(m).__name__}>"

    def _pre(self, m: torch.nn.Module, args: Any) -> None:
        self.stack.append(self._module_name(m))

    def _post(self, m: torch.nn.Module, args: Any, out: Any) -> None:
        name = self.stack.pop() if self.stack else self._module_name(m)
        if self.module_birth is None and self.phase == "forward":
            outs = _float_tensors(tree_flatten(out)[0])
            if outs and (_has_nan(outs) or _has_inf(outs)):
                ins = _float_tensors(tree_flatten(args)[0])
                if not (_has_nan(ins) or _has_inf(ins)):
                    self.module_birth = ModuleBirth(
                        module=name, module_type=type(m).__name__,
                        inputs=[tensor_stats(t) for t in ins[:4]], output=tensor_stats(outs[0]))

    def record_birth(self, kind: str, op: str, ins: list[torch.Tensor], in_stats: list[dict[str, Any]],
                     out: torch.Tensor, scalars: list[float]) -> None:
        module = self.stack[-1] if self.stack else None
        node_name = None
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                node_name = node.name()
                origin = self.node_module.get(id(node))
                if origin is not None:
                    module = origin[0]
                elif node_name == "torch::autograd::AccumulateGrad" or "AccumulateGrad" in node_name:
                    var = getattr(node, "variable", None)
                    if var is not None:
                        module = self._param_owner(var)
        mtype = None
        if module is not None:
            mtype = next((self.types[id(m)] for n, m in self.model.named_modules() if n == module), None)
            if mtype is None and module.startswith("<"):
                mtype = module.strip("<>")
        names = [self.tensor_names[t.data_ptr()] for t in ins if t.data_ptr() in self.tensor_names]
        self.births.append(Birth(
            index=self.op_count, phase=self.phase, kind=kind, op=op, module=module,
            module_type=mtype, autograd_node=node_name, inputs=in_stats, output=tensor_stats(out),
            scalars=scalars[:4], tensor_names=names[:8]))

    def _param_owner(self, p: torch.Tensor) -> str | None:
        for mname, m in self.model.named_modules():
            for q in m.parameters(recurse=False):
                if q is p:
                    return mname
        return None

    def __enter__(self) -> "Tracer":
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        # Modules outside the model (a loss module) get generic global hooks for the stack only.
        own = {id(m) for m in self.model.modules()}

        def gpre(m: torch.nn.Module, args: Any) -> None:
            if id(m) not in own:
                self.stack.append(self._module_name(m))

        def gpost(m: torch.nn.Module, args: Any, out: Any) -> None:
            if id(m) not in own and self.stack:
                self.stack.pop()

        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(gpre))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(gpost))
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()
