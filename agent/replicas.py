"""DDP replica consistency: on sampled steps every rank checksums its parameters after the
optimizer step, and the ranks compare the sums through the job's c10d store.

DDP keeps one replica of the model per rank and never compares them: it broadcasts parameters
once, at construction, and from then on relies on every rank applying the same averaged gradient.
A replica that silently changes (a bit flip in a parameter, a rank-local in-place edit, a
non-deterministic optimizer kernel) trains on unnoticed: the all-reduce goes on averaging
gradients of different models. A NaN is a small share of silent data corruption; differing
replicas are an exact, cheap signal.

How (and what it costs):

- every ``every`` steps (declared at attach: ``AgentConfig.replica_every``), :meth:`ReplicaCheck.sample`
  takes one checksum per parameter on the device, right after the step's optimizer step
  (``watch.step``): the parameter's bits viewed as integers (int32 for float32), multiplied by
  the odd weights ``2i + 1`` of their positions (wrapping), summed in int64. Position-weighted,
  so it is order-sensitive (two swapped elements differ), and a change of one element always
  changes the sum (an odd weight times a non-zero difference of less than 2**32 is non-zero
  modulo 2**64). Cost: one elementwise product and one sum per parameter, about as much as
  reading the parameters twice (bench figure in docs/distributed.md); no host-device sync: the
  sums are copied non-blocking and read by the background thread.
- the background thread of :class:`~.peers.PeerIncidents` (already polling the store) sets this
  rank's sums under ``sentineld/<run>/replica/<step>/<rank>`` and, once every rank's are there,
  compares them: one ``set``, W ``check``/``get`` per sampled step, no collective.
- differing sums name the ranks off the majority (with two ranks, both: no majority) and the
  first parameter (in ``named_parameters`` order) that differs; the training thread then writes
  a ``replica_divergence`` capture of that step (every rank sees the same comparison, so every
  rank captures) and puts a ``replica_divergence`` record in its stream.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["Divergence", "ReplicaCheck", "checksums", "compare"]

log = logging.getLogger("sentineld.agent")

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Weights:
    """The odd position weights ``2i + 1`` (int32, wrapping), one tensor per device, grown as needed."""

    def __init__(self) -> None:
        self._w: dict[torch.device, torch.Tensor] = {}

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        w = self._w.get(device)
        if w is None or w.numel() < n:
            w = torch.arange(n, dtype=torch.int32, device=device).mul_(2).add_(1)
            self._w[device] = w
        return w[:n]


def checksums(params: Sequence[torch.Tensor], weights: _Weights | None = None) -> torch.Tensor:
    """One order-sensitive int64 checksum per tensor, on the tensors' device: ``(P,)`` int64.

    Raises:
        ValueError: a tensor of an element size with no integer view (complex128 and wider).
    """
    weights = weights or _Weights()
    out = []
    with torch.no_grad():
        for p in params:
            t = p.detach()
            t = t.contiguous().view(-1) if not t.is_contiguous() else t.reshape(-1)
            size = t.element_size()
            if size not in _INT:
                raise ValueError(f"no integer view of {t.dtype} for a checksum")
            bits = t.view(_INT[size])
            w = weights.get(t.numel(), t.device)
            prod = bits.to(torch.int64) * w if size == 8 else bits.to(torch.int32) * w
            out.append(prod.sum(dtype=torch.int64))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(out)


@dataclass(frozen=True)
class Divergence:
    """Replicas that differ at a step: ``ranks`` off the majority, the first differing ``parameter``."""

    step: int
    ranks: list[int]
    parameter: str

    def message(self, world: int) -> str:
        """One line for the stream and the capture."""
        return (f"DDP replicas differ after the optimizer step of step {self.step}: rank(s) {self.ranks} of "
                f"{world} hold other values, first in parameter {self.parameter!r}")


def compare(step: int, sums: dict[int, list[int]], names: list[str]) -> Divergence | None:
    """The divergence among the ranks' checksums of one step, or None when all are equal.

    The ranks named are those whose sums differ from the most common sums (ties, as with two
    ranks: every rank not in the lowest-ranked of the largest groups, plus that group when it
    is not a strict majority: with two ranks both are named, nothing tells which one changed).
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(sums):
        groups.setdefault(tuple(sums[r]), []).append(r)
    if len(groups) <= 1:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    ref, majority = ordered[0]
    strict = len(majority) > len(sums) - len(majority)
    ranks = sorted(r for key, rs in groups.items() for r in rs if key != ref or not strict)
    other = next(key for key, _rs in ordered[1:])
    first = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), 0)
    return Divergence(step, ranks, names[first] if first < len(names) else f"#{first}")


class ReplicaCheck:
    """This rank's end of the replica comparison (the training thread samples, the peers thread
    publishes and compares).

    Args:
        store: the job's ``torch.distributed.Store``.
        run_id, rank, world: keys are ``sentineld/<run id>/replica/<step>/<rank>``.
        model: the unwrapped DDP model (its replicated parameters, ``named_parameters`` order).
        every: steps between samples (a sample at each step ``n`` with ``n % every == 0``).
    """

    def __init__(self, store: Any, run_id: str, rank: int, world: int, model: torch.nn.Module,
                 every: int) -> None:
        self._store, self.rank, self.world, self.every = store, rank, world, every
        self._prefix = f"sentineld/{run_id}/replica/"
        named = [(n, p) for n, p in model.named_parameters()]
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._weights = _Weights()
        self._lock = threading.Lock()
        self._pending: list[tuple[int, torch.Tensor, Any]] = []  # (step, sums, event)
        self._waiting: list[int] = []  # steps published, not yet compared
        self._published: list[int] = []
        self.divergences: list[Divergence] = []
        self.samples = 0

    def due(self, step: int) -> bool:
        """Whether ``step`` is sampled."""
        return self.every > 0 and step % self.every == 0

    def sample(self, step: int) -> None:
        """Checksum the parameters now (after ``step``'s optimizer step; the training thread)."""
        sums = checksums(self._params, self._weights)
        event = None
        if sums.device.type == "cuda":
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            sums = host
        with self._lock:
            self._pending.append((step, sums, event))
        self.samples += 1

    def take(self) -> list[Divergence]:
        """Divergences found since the last call (the training thread)."""
        with self._lock:
            got, self.divergences = self.divergences, []
        return got

    def settle(self, timeout_s: float, poll: Any) -> None:
        """At close: ``poll()`` until every published sample was compared, for at most ``timeout_s``
        (a peer that already closed published its last sample before its close)."""
        import time  # noqa: PLC0415

        deadline = time.monotonic() + timeout_s
        while True:
            poll()
            if not self._waiting or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def poll(self) -> None:
        """Publish sampled sums and compare the steps every rank has published (the peers thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for step, sums, event in pending:
            if event is not None:
                event.synchronize()  # this thread only
            self._store.set(f"{self._prefix}{step}/{self.rank}", ",".join(str(int(x)) for x in sums.tolist()))
            self._waiting.append(step)
            self._published.append(step)
        for step in list(self._waiting):
            keys = [f"{self._prefix}{step}/{r}" for r in range(self.world)]
            if not self._store.check(keys):
                continue  # a peer has not reached this step's sample yet
            self._waiting.remove(step)
            sums_of = {r: [int(x) for x in self._store.get(k).decode().split(",") if x]
                       for r, k in enumerate(keys)}
            div = compare(step, sums_of, self.names)
            if div is not None:
                with self._lock:
                    self.divergences.append(div)
        # Keep the store small: this rank's sums of samples every rank has long compared.
        while len(self._published) > 4:
            old = self._published.pop(0)
            try:
                self._store.delete_key(f"{self._prefix}{old}/{self.rank}")
            except Exception:  # noqa: BLE001 - a store without delete_key: the keys stay
                pass
