"""Tensor checks the tracer and the verdict share: finiteness, NaN/Inf flags, evidence statistics,
and running them on one thread."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch

__all__ = ["tensor_stats", "nonfinite_flags", "is_finite", "one_thread"]


def _float_tensors(objs: Iterable[Any]) -> list[torch.Tensor]:
    return [o for o in objs if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
            and o.numel() and o.device.type != "meta"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run checks on one thread: on a busy two-core machine a two-thread reduction of a small
    tensor waits milliseconds for a descheduled sibling (measured 2.2 ms vs 11 us). The step's own
    ops keep the run's thread count (bit-for-bit reproduction depends on it)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor (an FSDP2 shard, replay/fsdp_relaunch.py) is checked on this rank's shard: a
    # reduction over the DTensor would be a collective, run only on the ranks whose control flow
    # reaches it (a hang); the ranks agree on the verdict afterwards.
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and callable(to_local) else t


def is_finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` is finite (max and min reductions: no temporary the size of ``t``).
    For a DTensor: every element of this rank's local shard."""
    t = _local(t)
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def nonfinite_flags(ts: Iterable[torch.Tensor]) -> tuple[bool, bool]:
    """``(any NaN, any +-Inf)`` over tensors; two reductions per finite tensor."""
    nan = inf = False
    for t in ts:
        t = _local(t)
        if is_finite(t):
            continue
        nan = nan or bool(torch.isnan(t).any())
        inf = inf or bool(torch.isinf(t).any())
        if nan and inf:
            break
    return nan, inf


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Evidence for one tensor: dtype, shape, min / max / max|x| over finite values, counts.

    Returns a JSON-ready dict: ``dtype``, ``shape``, and for floating tensors ``numel``, ``nan``,
    ``posinf``, ``neginf``, ``nonfinite``, ``zeros``, ``min``, ``max``, ``finite_max_abs`` (the
    last three None when nothing is finite).
    """
    t = _local(t.detach())
    stats: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return stats
    f = t.float() if not t.is_complex() else t.abs().float()
    finite = torch.isfinite(f)
    vals = f[finite]
    nan = int(torch.isnan(f).sum())
    posinf, neginf = int((f == math.inf).sum()), int((f == -math.inf).sum())
    stats.update(
        numel=int(t.numel()), nan=nan, posinf=posinf, neginf=neginf, nonfinite=nan + posinf + neginf,
        zeros=int((f == 0).sum()),
        min=float(vals.min()) if vals.numel() else None,
        max=float(vals.max()) if vals.numel() else None,
        finite_max_abs=float(vals.abs().max()) if vals.numel() else None,
    )
    return stats
