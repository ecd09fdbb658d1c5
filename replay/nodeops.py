"""Which forward op made an autograd node, and whether torch.where selected from its output.

A birth in backward happens inside a derivative formula: ``rsqrt`` inside ``AcosBackward0``,
``log`` inside ``PowBackward1``. The user wrote ``acos`` / ``pow``, so the verdict names the
forward op. It is recorded while the graph is built: the tracer's dispatch mode sees each forward
op, and the autograd node that op created is the ``grad_fn`` its outputs carry once the op returned
(autograd sets it after the dispatch mode's handler, so the outputs of one op are looked at when
the next one starts, :meth:`NodeOps.flush`). A custom ``torch.autograd.Function``'s node names its
Function class; a node made while nothing was traced falls back to its name (``AcosBackward0`` ->
``aten.acos``, checked against the aten namespace).

``torch.where(cond, a, b)`` / ``masked_fill`` pass a zero gradient to the elements they did not
select, and 0 times an infinite derivative (or 0/0) is NaN even though the forward value was
discarded. :meth:`NodeOps.where_fed` says whether a node's output went into such a selector (or
through at most :data:`SELECT_DEPTH` nodes in between, e.g. ``where(m, 2 * sqrt(x), 0)``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["NodeOps", "SELECTOR_OPS", "op_from_node_name", "custom_function_name"]

#: Ops that keep some elements of an input and replace the others (their backward zero-fills).
SELECTOR_OPS = frozenset({"aten.where", "aten.masked_fill", "aten.masked_fill_", "aten.masked_scatter"})
#: Autograd nodes allowed between a node and the selector that took its output.
SELECT_DEPTH = 2
_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def custom_function_name(node: Any) -> str | None:
    """Class name of the custom ``torch.autograd.Function`` whose backward ``node`` is, else None."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        cls = getattr(node, "_forward_cls", None)
        return cls.__name__ if cls is not None else type(node).__name__.removesuffix("Backward")
    return None


def _makes_nodes(packet: Any) -> bool:
    """Some (non-``out``) overload of the aten op has its own autograd formula: it is not only a
    composite of other ops (``softmax`` is; its node comes from ``_softmax``)."""
    implicit = torch._C.DispatchKey.CompositeImplicitAutograd
    for name in packet.overloads():
        if name.endswith("out"):
            continue
        try:
            if not getattr(packet, name).has_kernel_for_dispatch_key(implicit):
                return True
        except RuntimeError:  # an overload listed but not registered in this build
            continue
    return False


def op_from_node_name(name: str) -> str | None:
    """``"AcosBackward0"`` -> ``"aten.acos"``, ``"SoftmaxBackward0"`` -> ``"aten._softmax"``: the aten
    op of that name that makes autograd nodes itself, else None."""
    stem = _BACKWARD_SUFFIX.sub("", name.removeprefix("torch::autograd::"))
    if not stem or stem == name:
        return None
    snake = _CAMEL.sub("_", stem).lower()
    for cand in (snake, f"_{snake}", f"{snake}_forward"):
        packet = getattr(torch.ops.aten, cand, None)
        if packet is not None and _makes_nodes(packet):
            return f"aten.{cand}"
    return None


class NodeOps:
    """Forward op (and module) of each autograd node made while the forward was traced.

    Nodes are kept alive (their ``id`` is the key) until :meth:`clear`.
    """

    def __init__(self) -> None:
        self._info: dict[int, tuple[str, str | None, Any]] = {}  # id(node) -> (op, module, node)
        self._selected: dict[int, Any] = {}  # id(node) -> node whose output a selector took
        self._pending: tuple[str, str | None, list[torch.Tensor]] | None = None

    def flush(self) -> None:
        """Attribute the autograd nodes of the previous op's outputs (set once it returned)."""
        if self._pending is None:
            return
        op, module, outs = self._pending
        self._pending = None
        for t in outs:
            node = t.grad_fn
            if node is not None and id(node) not in self._info:
                self._info[id(node)] = (op, module, node)

    def observe(self, op: str, module: str | None, args: Any, kwargs: Any, out: Any) -> None:
        """Record forward op ``op`` (run inside ``module``) with its arguments and outputs."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs and torch.is_grad_enabled():
            self._pending = (op, module, outs)
        if op in SELECTOR_OPS:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    self._selected[id(t.grad_fn)] = t.grad_fn

    def forward_op(self, node: Any) -> tuple[str | None, str | None, bool]:
        """``(forward op, module it ran in, known)`` for ``node``; known False when the node was
        not seen being made (its op then comes from its name, its module is unknown)."""
        custom = custom_function_name(node)
        info = self._info.get(id(node))
        if custom is not None:
            return custom, (info[1] if info else None), info is not None
        if info is not None:
            return info[0], info[1], True
        return op_from_node_name(node.name()), None, False

    def where_fed(self, node: Any) -> bool:
        """``node``'s output reached a selector op within :data:`SELECT_DEPTH` nodes."""
        target = id(node)
        for sel in self._selected.values():
            frontier, depth = [sel], 0
            while frontier and depth <= SELECT_DEPTH:
                if any(id(n) == target for n in frontier):
                    return True
                frontier = [c for n in frontier for c, _ in n.next_functions if c is not None]
                depth += 1
        return False

    def clear(self) -> None:
        self._info.clear()
        self._selected.clear()
        self._pending = None
