"""The agent's host-memory bound, stated at attach (log line and the
``sentineld_agent_ring_memory_bound_bytes`` gauge).

What the agent keeps in host memory, by construction (agent/ring.py, agent/localize_live.py):

- batches of the last ``window`` steps, at most ``ring_bytes`` bytes (oldest dropped first);
- with forward-only in-process localization, the forward arguments of those steps, also at most
  ``ring_bytes`` (a tensor that is both a forward argument and in the batch is held once);
- two snapshots, each one copy of parameters + buffers + optimizer state, plus the gradients
  when the loop leaves them set at the step start (``zero_grad(set_to_none=False)``,
  accumulation across steps): counted here, so the figure is an upper bound.

Not counted: the second copy the in-process localizer makes while it replays an incident
(``localize_memory_bytes`` in run.json, logged separately), and the capture writer's transient
HDF5 buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .agent_config import AgentConfig
from .sharded import local

__all__ = ["MemoryBound", "memory_bound", "optimizer_state_estimate"]


@dataclass(frozen=True)
class MemoryBound:
    """Upper bound of the ring's host memory, bytes, by part (see the module docstring)."""

    batches: int
    forward_args: int
    snapshot: int

    @property
    def total(self) -> int:
        """Batches + forward arguments + two snapshots."""
        return self.batches + self.forward_args + 2 * self.snapshot

    def describe(self) -> str:
        """One line for the attach log."""
        return (f"ring host memory at most {_mib(self.total)} (batches <= {_mib(self.batches)}"
                + (f", forward args <= {_mib(self.forward_args)}" if self.forward_args else "")
                + f", 2 snapshots x {_mib(self.snapshot)})")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _nbytes(t: torch.Tensor) -> int:
    # A lazy module's parameter has no shape until its first forward (numel() raises): 0 here,
    # so attach never fails on it; the figure then leaves that parameter out.
    if torch.nn.parameter.is_lazy(t):
        return 0
    # An FSDP2 parameter (and its gradient, Adam's moments) is a DTensor whose numel() is the
    # global size; the ring copies the local shard only (agent/sharded.py: to_host_sharded),
    # 1/W of it: count that, or the bound overstates a W-rank job's memory W times.
    t = local(t)
    return t.numel() * t.element_size()


def optimizer_state_estimate(optimizer: torch.optim.Optimizer, param_bytes: int) -> int:
    """Optimizer state bytes now, or before the first step a figure from its class: Adam-family
    keeps two moments per parameter (AdamW, Adamax, NAdam, RAdam too), momentum SGD one, else 0."""
    have = sum(_nbytes(v) for st in list(optimizer.state.values())
               for v in list(st.values()) if isinstance(v, torch.Tensor))
    if have:
        return have
    name = type(optimizer).__name__.lower()
    per = 2 if "adam" in name else 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
    return per * param_bytes


def memory_bound(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: AgentConfig,
                 forward_only_localizer: bool) -> MemoryBound:
    """The bound for ``model`` + ``optimizer`` under ``config``.

    Args:
        model: the (unwrapped) model; a tied tensor counts once; a DTensor (FSDP2) counts its
            local shard (what this rank's ring holds).
        optimizer: its optimizer (state estimated from its class before the first step).
        config: ``ring_bytes`` bounds batches (and forward arguments).
        forward_only_localizer: in-process localization keeps forward arguments.
    """
    seen: set[int] = set()
    params = buffers = grads = 0
    for t in model.parameters():
        if id(t) not in seen:
            seen.add(id(t))
            params += _nbytes(t)
            grads += _nbytes(t) if t.requires_grad else 0
    for b in model.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            buffers += _nbytes(b)
    snapshot = params + buffers + grads + optimizer_state_estimate(optimizer, params)
    return MemoryBound(batches=config.ring_bytes,
                       forward_args=config.ring_bytes if forward_only_localizer else 0,
                       snapshot=snapshot)
