"""Every rank of a data-parallel job captures the step where any rank went non-finite.

A DDP step is replayed from every rank's batch (:mod:`sentineld.replay.ddp`). Usually every rank
opens its own incident at the same step: the all-reduce spreads a rank's non-finite gradient to
all, so every rank's grad norm is non-finite. But a rank can go non-finite alone: its loss is
non-finite while its gradients are finite (a NaN in a detached term, a metric folded into the
loss), or only its batch trips the input check. Then the other ranks see finite values and
would write no capture, and the replay would lack their batches.

So a rank that opens an incident says so through the job's own c10d store (the TCPStore every
``init_process_group`` has): one ``add`` on a counter and one ``set``, at the incident only. A
background thread on every rank polls the counter (one ``add(key, 0)`` every ``interval_s``); the
training thread only reads a list's truthiness per step and, when a peer's incident arrived,
writes this rank's capture of that step from its ring. No collective is added to any training
step. ``close`` polls once more, so an incident announced in the last steps is not missed (the
job's later all-reduces order the announcement before it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

__all__ = ["PeerIncidents", "peer_incidents"]

log = logging.getLogger("sentineld.agent")


def _default_store() -> Any:
    """The default process group's store, or None (not initialised, or a torch without it)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private API: absent or changed means no peer signal
        return None


class PeerIncidents:
    """This rank's end of the incident announcements of one run.

    Args:
        store: a ``torch.distributed.Store`` shared by the job's ranks.
        run_id: the run (keys are ``sentineld/<run id>/...``, so runs of one job do not mix).
        rank: this rank.
        interval_s: seconds between polls of the background thread (how late a peer capture
            starts at most, plus a step).
    """

    def __init__(self, store: Any, run_id: str, rank: int, interval_s: float = 0.25) -> None:
        self._store, self.rank = store, rank
        self._prefix = f"sentineld/{run_id}/"
        self._seen = 0
        self._lock = threading.Lock()
        self._own: set[int] = set()
        self._done: set[int] = set()
        self.requests: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._failed = False
        self.replicas: Any = None  # a ReplicaCheck (agent/replicas.py): polled by the same thread
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="sentineld-peers",
                                        daemon=True)
        self._thread.start()

    def publish(self, step: int) -> None:
        """Announce that this rank opened an incident at ``step`` (the training thread, at the incident)."""
        self._own.add(step)
        try:
            n = self._store.add(self._prefix + "incidents", 1)
            self._store.set(f"{self._prefix}incident/{n}", f"{self.rank}:{step}")
        except Exception as exc:  # noqa: BLE001 - a store gone (job ending) must not break training
            self._fail(exc)

    def poll(self) -> None:
        """Read announcements made since the last poll; peers' steps go to :attr:`requests`."""
        n = int(self._store.add(self._prefix + "incidents", 0))
        while self._seen < n:
            key = f"{self._prefix}incident/{self._seen + 1}"
            if not self._store.check([key]):
                return  # counted but not yet written: read it at the next poll
            rank_s, _, step_s = self._store.get(key).decode().partition(":")
            self._seen += 1
            if int(rank_s) != self.rank:
                with self._lock:
                    self.requests.append((int(step_s), int(rank_s)))

    def take(self) -> list[tuple[int, int]]:
        """``(step, rank)`` of peers' incidents this rank has no capture of yet (each step once)."""
        with self._lock:
            got, self.requests = self.requests, []
        out = []
        for step, rank in got:
            if step not in self._own and step not in self._done:
                self._done.add(step)
                out.append((step, rank))
        return out

    def stop(self) -> None:
        """Stop the background thread (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def close(self, settle_s: float = 5.0) -> None:
        """Stop the thread and poll one last time (replica samples: until compared, at most ``settle_s``)."""
        self.stop()
        if not self._failed:
            try:
                self.poll()
                if self.replicas is not None:
                    self.replicas.settle(settle_s, self.replicas.poll)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll()
                if self.replicas is not None:
                    self.replicas.poll()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            log.warning("sentineld: rank %d cannot reach the job's store (%s); other ranks' incidents "
                        "will not trigger captures on this rank", self.rank, exc)


def peer_incidents(run_id: str, rank: int, world: int, model: Any = None,
                   replica_every: int = 0) -> PeerIncidents | None:
    """A :class:`PeerIncidents` for a multi-rank job with an initialised process group, else None.

    Args:
        model: the unwrapped model; with ``replica_every > 0`` and unsharded parameters (DDP: one
            replica per rank) its replicas are compared every ``replica_every`` steps
            (:mod:`.replicas`). A sharded (FSDP2) model has no replicas to compare.
    """
    if world <= 1:
        return None
    store = _default_store()
    if store is None:
        return None
    peers = PeerIncidents(store, run_id, rank)
    if model is not None and replica_every > 0:
        from .replicas import ReplicaCheck  # noqa: PLC0415

        peers.replicas = ReplicaCheck(store, run_id, rank, world, model, replica_every)
    return peers
