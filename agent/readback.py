"""Reading a step's device values back without a host-device sync: the global grad norm is
computed on device, copied non-blocking into pinned memory with a CUDA event, and turned into a
:class:`~sentineld.contracts.records.StepRecord` once the event completed (normally one step
later). On CPU the values are read at once.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterator

import torch

from sentineld.contracts.records import StepRecord

from .incidents import batch_nonfinite
from .ring import RingEntry
from .sharded import is_dtensor

__all__ = ["grad_norm", "Readback"]


#: Per-parameter gradient norms one :func:`grad_norm` call took: ``id(param) -> (the gradient
#: tensor, its version counter then, its L2 norm as a 0-dim device tensor)``.
GradNorms = dict[int, tuple[torch.Tensor, int, torch.Tensor]]


def grad_norm(optimizer: torch.optim.Optimizer, per_param: GradNorms | None = None) -> torch.Tensor | None:
    """Global L2 norm of the optimizer's dense gradients, on device (fused ``_foreach_norm``,
    one kernel per device and dtype; float16/bfloat16 accumulate in float32: a float16 norm
    overflows at 65504 long before any element does). None when no parameter has a gradient.

    ``per_param``: filled with each plain (not FSDP2) dense gradient's own norm, the per-tensor
    values the global one is made of (float32; the layer probes of a full sample reuse them
    instead of a second pass over every gradient, ``agent/probes.py``)."""
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    owners: dict[tuple[torch.device, torch.dtype], list[torch.Tensor | None]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            plain = True
            if g is not None and type(g) is not torch.Tensor and is_dtensor(g):
                g = g.to_local()  # FSDP2: this rank's shard; no collective (agent/sharded.py)
                plain = False
            if g is not None and not g.is_sparse:
                key = (g.device, g.dtype)
                by_device.setdefault(key, []).append(g)
                if per_param is not None:   # (a full layer sample only: nothing added to other steps)
                    owners.setdefault(key, []).append(p if plain else None)
    if not by_device:
        return None
    norms: list[torch.Tensor] = []
    for key, grads in by_device.items():
        low = grads[0].dtype in (torch.float16, torch.bfloat16)
        ns = [n.float() for n in (torch._foreach_norm(grads, 2, dtype=torch.float32) if low
                                  else torch._foreach_norm(grads))]
        norms.extend(ns)
        if per_param is not None:
            for p, g, n in zip(owners[key], grads, ns):
                if p is not None and not g.is_inference():   # (an inference tensor has no version)
                    per_param[id(p)] = (g, g._version, n)
    dev = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(dev, non_blocking=True) for n in norms]))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    return out


class _Pending:
    """A step whose device values are in flight to the host."""

    __slots__ = ("step", "values", "event", "fields", "entry")

    def __init__(self, step: int, values: list[torch.Tensor | None], event: Any,
                 fields: dict[str, Any], entry: RingEntry) -> None:
        self.step, self.values, self.event, self.fields, self.entry = step, values, event, fields, entry

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


class Readback:
    """Steps waiting for their values, oldest first."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def push(self, step: int, values: list[torch.Tensor | None], fields: dict[str, Any],
             entry: RingEntry) -> Any:
        """Queue a step's ``[loss, grad norm, lr tensor, loss scale, batch sum]`` (any None; see
        :func:`.incidents.batch_check`); returns the
        CUDA event its copies complete on (None on CPU)."""
        event = None
        if any(v is not None and v.device.type != "cpu" for v in values):
            values = [None if v is None else _pinned(v) for v in values]
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(step, values, event, fields, entry))
        return event

    def ready(self) -> Iterator[tuple[StepRecord, RingEntry, int]]:
        """``(record, ring entry, step)`` of each step whose values landed, in step order."""
        while self._pending and self._pending[0].ready():
            p = self._pending.popleft()
            loss, gnorm, lr_t, scale, batch_sum = (None if v is None else float(v) for v in p.values)
            fields = dict(p.fields)
            clip = fields.pop("clip_grad_norm", None)
            # clip_grad_norm_ rescales unless total <= max_norm (a nan/inf total too)
            fields["clipped"] = None if clip is None or gnorm is None else not gnorm <= clip
            if lr_t is not None:
                fields["lr"] = lr_t
            if batch_sum is not None:
                # A non-finite sum can be finite elements overflowing: the host copy decides.
                fields["input_nonfinite"] = (not math.isfinite(batch_sum)
                                             and batch_nonfinite(p.entry.batch) is not False)
            record = StepRecord(loss=float("nan") if loss is None else loss, grad_norm=gnorm,
                                loss_scale=scale, **fields)
            yield record, p.entry, p.step

    def wait_all(self) -> None:
        """Block until every queued copy landed (at close: no more steps will come)."""
        for p in self._pending:
            if p.event is not None:
                p.event.synchronize()
