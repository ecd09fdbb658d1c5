"""Instrumentation for one replayed step: where was the first non-finite value *born*?

A value is born non-finite by an op when
- its output holds NaN while no tensor input and no scalar argument held NaN, or
- its output holds +-Inf while every tensor input and scalar argument was finite.

So ``masked_fill(x, mask, -inf)`` (a non-finite scalar argument) is not a birth, ``softmax`` of a
fully masked row (NaN from -inf inputs) is, and ``log(0)`` is. An in-place op's output is the
tensor it wrote (``_foreach_mul_`` of gradient clipping returns nothing). Every aten op is observed
through a ``TorchDispatchMode`` in forward, backward and the optimizer step alike (the autograd
engine carries the mode into backward).

Module forward hooks keep the module stack and, for each module call, whether its output was
non-finite and which autograd nodes it created (found by walking the graph back from its outputs
to nodes older than the call, using autograd's sequence numbers). A birth in backward is traced to
its module through ``torch._C._current_autograd_node()``; an ``AccumulateGrad`` node to the module
owning the parameter. Its forward op (the op whose derivative ran, :mod:`replay.nodeops`) is
recorded while the graph is built; births whose values a later op dropped are marked masked
(:mod:`replay.masking`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .masking import Provenance
from .nodeops import NodeOps, custom_function_name
from .tensorstats import _float_tensors, is_finite, nonfinite_flags, one_thread, tensor_stats

__all__ = ["Birth", "ModuleCall", "Tracer", "tensor_stats", "nonfinite_flags", "is_finite", "one_thread"]

# Ops that compute nothing: factories return uninitialised memory (which may hold NaN bit patterns
# by chance), and detach/alias/set_ only relabel storage. Views are skipped via ``OpOverload.is_view``.
_SKIP_PREFIXES = ("aten.empty", "aten.new_empty", "aten.set_", "aten.detach", "aten.lift_fresh",
                  "aten.alias", "aten.resize_", "aten._local_scalar_dense", "aten.is_nonzero")
_SEQ_NONE = 2 ** 64 - 1  # AccumulateGrad nodes carry UINT64_MAX as sequence number
_get_seq = getattr(torch._C._autograd, "_get_sequence_nr", None)


@dataclass
class Birth:
    """One op that produced a non-finite value from values that were not.

    Attributes:
        index: execution order among the observed ops of the step.
        phase: ``forward`` | ``backward`` | ``clip`` | ``optimizer`` | ``scheduler``.
        kind: ``nan`` or ``inf``.
        op: aten op name, e.g. ``aten.log`` (overload dropped).
        module: qualified module name (``named_modules()``) of the innermost module running the op
            (forward) or that created the autograd node (backward); None outside any module;
            ``<Type>`` for a module outside the model (a loss module).
        module_type: class name of that module.
        call: index into :attr:`Tracer.calls` of the innermost module call (forward), else None.
        micro: micro-batch index (forward/backward).
        autograd_node: in backward, the autograd node's name (e.g. ``SqrtBackward0``).
        forward_op: in backward, the forward op whose derivative the node computes (``aten.sqrt``),
            or a custom autograd Function's class name; None for ``AccumulateGrad``.
        custom_function: in backward, the custom autograd Function whose backward ran, else None.
        where_branch: in backward, the node's forward output went into ``torch.where`` /
            ``masked_fill`` (its unselected elements get a zero gradient).
        masked: a later op dropped every non-finite value seen descending from it.
        root: position in :attr:`Tracer.births` of the earliest birth it descends from.
        inputs, output: :func:`tensor_stats` of the op's tensor inputs (first four) and output.
        scalars: non-tensor numeric arguments.
        tensor_names: names of parameters / gradients / optimizer state among the op's tensors.
        samples: for an output whose first dimension is the batch's (:attr:`Tracer.batch_rows`),
            the rows (samples of the batch) holding a non-finite value, at most 64; else None.
    """

    index: int
    phase: str
    kind: str
    op: str
    module: str | None
    module_type: str | None
    call: int | None = None
    micro: int = 0
    autograd_node: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] = field(default_factory=dict)
    scalars: list[float] = field(default_factory=list)
    tensor_names: list[str] = field(default_factory=list)
    forward_op: str | None = None
    custom_function: str | None = None
    where_branch: bool = False
    masked: bool = False
    root: int = 0
    samples: list[int] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready short form for evidence."""
        return {"phase": self.phase, "kind": self.kind, "op": self.op, "module": self.module,
                "autograd_node": self.autograd_node, "forward_op": self.forward_op,
                "custom_function": self.custom_function, "where_branch": self.where_branch,
                "masked": self.masked, "micro_batch": self.micro, "samples": self.samples,
                "inputs": self.inputs, "output": self.output, "tensors": self.tensor_names}


@dataclass
class ModuleCall:
    """One forward call of a module, with what came out of it.

    Attributes:
        name, module_type: qualified name and class.
        micro: micro-batch index.
        out_nan, out_inf: the output held NaN / Inf; in_nan, in_inf: the inputs did.
        tensors: ``(inputs, output)`` kept when the output was non-finite (see :meth:`stats`).
    """

    name: str
    module_type: str
    micro: int
    out_nan: bool = False
    out_inf: bool = False
    in_nan: bool = False
    in_inf: bool = False
    tensors: tuple[list[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)

    def stats(self) -> dict[str, Any]:
        """``{"inputs": [...], "output": {...}}`` tensor statistics (non-finite outputs only)."""
        if self.tensors is None:
            return {"inputs": [], "output": {}}
        with one_thread():
            return {"inputs": [tensor_stats(t) for t in self.tensors[0]],
                    "output": tensor_stats(self.tensors[1])}

    @property
    def born_here(self) -> bool:
        """Output non-finite while the inputs were finite (of the same kind, NaN from NaN-free)."""
        return (self.out_nan and not self.in_nan) or (self.out_inf and not (self.in_nan or self.in_inf))


class _Dispatch(TorchDispatchMode):
    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tr = self.tracer
        name = str(getattr(func, "overloadpacket", func))
        name = name if name.startswith("aten.") else f"aten.{name}"
        if (not tr.active or tr.paused or not tr.wants_birth or getattr(func, "is_view", False)
                or name.startswith(_SKIP_PREFIXES)):
            return func(*args, **kwargs)
        forward = tr.phase == "forward"
        if forward:
            tr.nodes.flush()
        leaves = tree_flatten((args, kwargs))[0]
        ins = _float_tensors(leaves)
        scalars = [float(x) for x in leaves if isinstance(x, float)]
        with one_thread():
            in_nan, in_inf = nonfinite_flags(ins)
            parents = tr.prov.parents(ins) if in_nan or in_inf else frozenset()
            in_nan = in_nan or any(math.isnan(s) for s in scalars)
            in_inf = in_inf or any(math.isinf(s) for s in scalars)
            mutated = _float_tensors(_mutated(func, args, kwargs)) if not in_nan or parents else []
            before = {id(t): t.clone() for t in mutated} if not in_nan else {}  # in-place overwrites
        out = func(*args, **kwargs)
        tr.op_count += 1
        if forward:
            tr.nodes.observe(name, tr.current_module(), args, kwargs, out)
        if in_nan and not parents:  # nothing can be born NaN or Inf from a NaN input
            return out
        outs = _float_tensors(tree_flatten(out)[0]) + mutated
        if not outs:
            return out
        with one_thread():
            out_nan, out_inf = nonfinite_flags(outs)
            kind = None if in_nan else "nan" if out_nan else "inf" if (out_inf and not in_inf) else None
            if kind is not None:
                bad = [t for t in outs if not is_finite(t)]
                in_stats = [tensor_stats(before.get(id(t), t)) for t in ins[:4]]
                tr.record_birth(kind, name, in_stats, bad[0], scalars, tr.names_of(ins + mutated))
                tr.prov.born(len(tr.births) - 1, bad, parents)
            elif parents and (out_nan or out_inf):
                tr.prov.carried([t for t in outs if not is_finite(t)], parents)
            elif parents:
                tr.prov.dropped(parents)
        return out


def _mutated(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """Tensors an op writes in place (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out: list[Any] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(tree_flatten(val)[0])
    return out


class Tracer:
    """Observe one step; :attr:`births` holds every birth in execution order.

    Use as a context manager around the step; call :meth:`set_phase` as phases change (it is
    passed to :func:`sentineld.contracts.recipe.train_step` as ``on_phase``).

    Args:
        model: the model whose modules are named in the report.
        namer: returns ``data_ptr -> name`` for parameters, gradients and optimizer state as they
            are at the moment of a birth (optimizer state is created inside the first step).
        max_births: stop looking for births after this many (the first ones are what matter).
    """

    def __init__(self, model: torch.nn.Module, namer: Callable[[], dict[int, str]] | None = None,
                 max_births: int = 64) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.types = {n: type(m).__name__ for n, m in model.named_modules()}
        self.owner = {p.data_ptr(): mn for mn, m in model.named_modules() for p in m.parameters(recurse=False)}
        self.namer = namer
        self.max_births = max_births
        self.phase = "forward"
        self.micro = -1
        #: The batch's size (first dimension of its tensors), when they agree: an op output of
        #: that first dimension is batch-major, and a birth names its non-finite rows.
        self.batch_rows: int | None = None
        self.births: list[Birth] = []
        self.calls: list[ModuleCall] = []
        self.op_count = 0
        #: False once the verdict's phase is known: the rest of the step runs untraced.
        self.active = True
        #: > 0 while the tracer's own checks run (their ops are not the step's).
        self.paused = 0
        self._stack: list[tuple[str, int, int]] = []  # (name, call index, first sequence nr)
        self._node_module: dict[int, tuple[str, Any]] = {}  # id(node) -> (module, node kept alive)
        self._handles: list[Any] = []
        self._mode: _Dispatch | None = None
        #: forward op of each autograd node made in the traced forward.
        self.nodes = NodeOps()
        #: which births descend from which, and which were masked.
        self.prov = Provenance()

    @property
    def wants_birth(self) -> bool:
        return len(self.births) < self.max_births

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Run the caller's own tensor checks without observing them (on one thread)."""
        self.paused += 1
        try:
            with one_thread():
                yield
        finally:
            self.paused -= 1

    def set_phase(self, phase: str) -> None:
        """Mark the start of ``phase`` (see :data:`sentineld.contracts.recipe.PHASES`)."""
        if phase == "forward":
            self.micro += 1
        elif self.phase == "forward":
            self.nodes.flush()
        self.phase = phase

    def current_module(self) -> str | None:
        """Innermost module running now (forward), None outside every module."""
        return self._stack[-1][0] if self._stack else None

    def finish(self) -> None:
        """Settle each birth's ``masked`` and ``root`` (call once the step ran)."""
        for i, b in enumerate(self.births):
            b.masked = i in self.prov.masked
            b.root = self.prov.root(i)

    def names_of(self, ts: list[torch.Tensor]) -> list[str]:
        """Names of parameters / grads / optimizer state among ``ts`` (only outside forward)."""
        if self.phase == "forward" or self.namer is None:
            return []
        names = self.namer()
        return list(dict.fromkeys(names[t.data_ptr()] for t in ts if t.data_ptr() in names))[:8]

    # ------------------------------------------------------------------ module hooks
    def _name(self, m: torch.nn.Module) -> str:
        name = self.names.get(id(m))
        return name if name is not None else f"<{type(m).__name__}>"

    def _pre(self, m: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
        if self.phase != "forward" or not self.active:
            return
        self.calls.append(ModuleCall(self._name(m), type(m).__name__, self.micro))
        self._stack.append((self._name(m), len(self.calls) - 1, _get_seq() if _get_seq else 0))

    def _post(self, m: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if self.phase != "forward" or not self._stack or not self.active:
            return
        name, ci, seq0 = self._stack.pop()
        call = self.calls[ci]
        outs = tree_flatten(out)[0]
        fouts = _float_tensors(outs)
        with self.pause():
            call.out_nan, call.out_inf = nonfinite_flags(fouts)
            if call.out_nan or call.out_inf:
                ins = _float_tensors(tree_flatten((args, kwargs or {}))[0])
                call.in_nan, call.in_inf = nonfinite_flags(ins)
                call.tensors = ([t.detach() for t in ins[:4]], fouts[0].detach())
        if _get_seq is not None and not name.startswith("<"):
            self._claim_nodes(outs, name, seq0)

    def _claim_nodes(self, outs: list[Any], name: str, seq0: int) -> None:
        """Assign autograd nodes created during this call (and not by an inner module) to ``name``."""
        todo = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            seq = node._sequence_nr()
            if seq < seq0 or seq == _SEQ_NONE:
                continue
            self._node_module.setdefault(id(node), (name, node))
            todo.extend(child for child, _ in node.next_functions if child is not None)

    # ------------------------------------------------------------------ births
    def record_birth(self, kind: str, op: str, in_stats: list[dict[str, Any]], out: torch.Tensor,
                     scalars: list[float], names: list[str]) -> None:
        module: str | None = self._stack[-1][0] if self._stack else None
        call = self._stack[-1][1] if self._stack else None
        node_name = fwd_op = custom = None
        where_branch = False
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            module = None
            if node is not None:
                node_name = node.name().removeprefix("torch::autograd::")
                origin = self._node_module.get(id(node))
                if "AccumulateGrad" not in node_name:
                    fwd_op, fwd_module, _ = self.nodes.forward_op(node)
                    custom = custom_function_name(node)
                    where_branch = self.nodes.where_fed(node)
                    module = fwd_module  # the module running the op that made the node
                if origin is not None:
                    module = origin[0]
                elif "AccumulateGrad" in node_name:
                    var = getattr(node, "variable", None)
                    module = self.owner.get(var.data_ptr()) if var is not None else None
                    if var is not None and self.namer is not None:
                        names = [self.namer().get(var.data_ptr(), "?")]
        elif self.phase != "forward":
            module = None
        mtype = self.types.get(module) if module is not None else None
        if mtype is None and module is not None and module.startswith("<"):
            mtype = module.strip("<>")
        self.births.append(Birth(
            samples=self._rows(out, names, node_name),
            index=self.op_count, phase=self.phase, kind=kind, op=op, module=module, module_type=mtype,
            call=call, micro=max(self.micro, 0), autograd_node=node_name, inputs=in_stats,
            output=tensor_stats(out), scalars=scalars[:4], tensor_names=names, forward_op=fwd_op,
            custom_function=custom, where_branch=where_branch))

    def _rows(self, out: torch.Tensor, names: list[str], node_name: str | None) -> list[int] | None:
        """Rows of a batch-major ``out`` holding NaN/Inf; None for a parameter, its gradient or
        optimizer state (a first dimension equal to the batch size there is a coincidence)."""
        B = self.batch_rows
        if (B is None or out.dim() == 0 or out.shape[0] != B or names or self.phase not in ("forward", "backward")
                or (node_name is not None and "AccumulateGrad" in node_name)):
            return None
        bad = ~torch.isfinite(out.detach())
        return bad.reshape(B, -1).any(dim=1).nonzero().flatten()[:64].tolist()

    def set_batch(self, batch: Any) -> None:
        """Take :attr:`batch_rows` from ``batch``'s tensors (None when their first dimensions differ)."""
        dims = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim()}
        self.batch_rows = dims.pop() if len(dims) == 1 else None

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "Tracer":
        own = {id(m) for m in self.model.modules()}
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))

        # Modules outside the model (a loss module) take part in the stack through global hooks,
        # from this thread only: the training process localizes while its training thread runs.
        tid = threading.get_ident()

        def gpre(m: torch.nn.Module, args: Any) -> None:
            if id(m) not in own and threading.get_ident() == tid:
                self._pre(m, args)

        def gpost(m: torch.nn.Module, args: Any, out: Any) -> None:
            if id(m) not in own and threading.get_ident() == tid:
                self._post(m, args, None, out)

        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(gpre))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(gpost))
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()
        self._node_module.clear()
        self.finish()
        self.nodes.clear()
        self.prov.clear()
