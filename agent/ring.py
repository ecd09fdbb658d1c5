"""The ring buffer: recent batches with their RNG states, and the last two state snapshots.

Memory is bounded by ``window`` steps and ``ring_bytes`` bytes of batches, plus two snapshots
(each the size of model + optimizer state). Two snapshots, not one: when an incident is read back
a step late (CUDA), the newest snapshot may already hold the corrupted state, and the one before
it is still clean.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from sentineld.contracts.treecodec import map_tensors

__all__ = ["RingEntry", "Snapshot", "Ring", "to_host", "tree_nbytes"]


@dataclass
class RingEntry:
    """One step's inputs: ``batch`` (host copies), ``rng`` at its first forward, scalar ``record``."""

    step: int
    batch: Any
    rng: Mapping[str, Any] | None
    record: dict[str, Any] | None
    nbytes: int


@dataclass
class Snapshot:
    """State dicts (host copies) before ``step`` ran; ``event`` completes when device copies land."""

    step: int
    state: dict[str, Any]
    event: Any = None
    nbytes: int = 0

    def wait(self) -> None:
        """Block until the device-to-host copies finished (no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    # Pinned destination makes the copy truly asynchronous: no host-device sync on the step.
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def to_host(tree: Any) -> Any:
    """Copy every tensor of ``tree`` to host memory (async from CUDA; pair with an event)."""
    return map_tensors(tree, _host_copy)


def tree_nbytes(tree: Any) -> int:
    """Bytes held by the tensors of ``tree``."""
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_tensors(tree, add)
    return total


class Ring:
    """Steps since the older of two snapshots, bounded by ``window`` steps and ``max_bytes``."""

    def __init__(self, window: int, max_bytes: int) -> None:
        self.window = window
        self.max_bytes = max_bytes
        self.entries: deque[RingEntry] = deque()
        self.snapshots: deque[Snapshot] = deque(maxlen=2)
        self.nbytes = 0

    def add_snapshot(self, snap: Snapshot) -> None:
        """Keep ``snap`` (in place of one of the same step); drop steps older than the oldest
        snapshot still kept."""
        if self.snapshots and self.snapshots[-1].step == snap.step:
            self.snapshots.pop()  # the initial snapshot, retaken at the first step
        self.snapshots.append(snap)
        oldest = self.snapshots[0].step
        while self.entries and self.entries[0].step < oldest:
            self._pop()

    def add_step(self, entry: RingEntry) -> None:
        """Append one step, evicting the oldest beyond the bounds."""
        self.entries.append(entry)
        self.nbytes += entry.nbytes
        while len(self.entries) > self.window or (self.nbytes > self.max_bytes and len(self.entries) > 1):
            self._pop()

    def _pop(self) -> None:
        e = self.entries.popleft()
        self.nbytes -= e.nbytes

    def span(self, step: int, before: int | None = None) -> tuple[Snapshot, list[RingEntry]] | None:
        """The newest snapshot S <= ``before`` (default ``step``) whose steps S..``step`` are all
        kept, with those steps."""
        have = {e.step: e for e in self.entries}
        limit = step if before is None else before
        for snap in reversed(self.snapshots):
            if snap.step > limit:
                continue
            wanted = range(snap.step, step + 1)
            if all(s in have for s in wanted):
                return snap, [have[s] for s in wanted]
        return None

