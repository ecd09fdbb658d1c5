"""The agent's side of the on-disk ring: :class:`DiskRingWriter` persists snapshots and steps as
the training takes them (format: :mod:`sentineld.contracts.ringformat`; recovery after a kill:
:mod:`sentineld.daemon.ring_recovery`)."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sentineld.contracts.h5write import disk_full_error
from sentineld.contracts.ringformat import LOCK_FILE, META_FILE, Packer, RingMeta, snap_file, step_file, write_ring_file
from sentineld.contracts.rundir import RunDir
from sentineld.contracts.safeio import write_atomic

__all__ = ["DiskRingWriter"]

log = logging.getLogger("sentineld.diskring")


class DiskRingWriter:
    """Persist snapshots and steps under ``run_dir`` from a background thread.

    The training thread only queues references to host copies it already made (bounded queue of
    ``window`` items; when the disk falls behind, items are dropped and counted, never waited
    for). One warning is logged for the first write that fails (e.g. a full disk); training goes
    on and later writes are still tried.

    Args:
        run_dir: the run directory.
        rank: this process's rank.
        window: most steps kept on disk.
        run_id: the run's id, and ``torch_version`` the training's torch, for ``meta.json``
            (:class:`~sentineld.contracts.ringformat.RingMeta`; the crash capture's attributes).
        on_warning: called once with the warning text (the agent puts it in the stream).

    Raises:
        OSError: the directory or its lock cannot be created.
    """

    def __init__(self, run_dir: Path, rank: int, window: int, *, run_id: str, torch_version: str,
                 on_warning: Callable[[str], None] | None = None) -> None:
        names, n = RunDir(run_dir), 0
        d = run_dir / names.ring_name(rank, os.getpid())
        while d.exists():  # a dead process with our pid left one: keep it for recovery
            n += 1
            d = run_dir / names.ring_name(rank, os.getpid(), n)
        # Built under a hidden name and renamed once locked: a watcher never sees the ring
        # without its lock held (it would take the ring for a dead process's).
        init = run_dir / f".{d.name}.init"
        shutil.rmtree(init, ignore_errors=True)
        init.mkdir(mode=0o700)
        self._lock_fd = os.open(init / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        meta = RingMeta(rank=rank, pid=os.getpid(), host=socket.gethostname(), window=window, run_id=run_id,
                        torch_version=torch_version)
        write_atomic(init / META_FILE, meta.to_json(), durable=False)
        os.rename(init, d)
        self.dir = d
        self.window = window
        self.dropped = 0
        self.written = 0
        self.failures = 0
        self._on_warning = on_warning
        self._warned = False
        self._snaps: list[int] = []
        self._steps: list[int] = []
        self._max_items = max(2, window)
        self._items: deque[tuple[str, Any, Any]] = deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="sentineld-diskring", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ producer
    def add_snapshot(self, snap: Any) -> None:
        """Queue a snapshot (an object with ``step``, ``state`` and ``wait()``)."""
        self._put(("snap", snap, None))

    def add_step(self, entry: Any, event: Any = None) -> None:
        """Queue a step (an object with ``step``, ``batch``, ``rng``, ``record``); ``event``
        completes when its device-to-host copies landed (None on CPU)."""
        self._put(("step", entry, event))

    def _put(self, item: tuple[str, Any, Any]) -> None:
        # Lock-free (deque append, SimpleQueue put): safe from a signal handler on this thread.
        if len(self._items) >= self._max_items:
            self.dropped += 1
            return
        self._items.append(item)
        self._wake.put(None)

    # -------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            try:
                self._wake.get(timeout=1.0)
            except queue.Empty:
                pass
            while True:
                self._busy = True
                try:
                    kind, obj, event = self._items.popleft()
                except IndexError:
                    self._busy = False
                    break
                try:
                    if kind == "snap":
                        self._write_snap(obj)
                    else:
                        self._write_step(obj, event)
                    self.written += 1
                except Exception as exc:  # noqa: BLE001 - disk full etc.: training goes on
                    self.failures += 1
                    self._warn(exc)
                finally:
                    self._busy = False
            if self._stop:
                return

    def _warn(self, exc: BaseException) -> None:
        if self._warned:
            return
        self._warned = True
        full = disk_full_error(exc, self.dir)
        text = (f"on-disk ring {self.dir.name}: write failed: {full or exc}; later writes are still "
                "tried (training continues; a crash capture after SIGKILL may cover fewer steps)")
        log.warning("sentineld: %s", text)
        if self._on_warning is not None:
            try:
                self._on_warning(text)
            except Exception:  # noqa: BLE001
                pass

    def _write_snap(self, snap: Any) -> None:
        snap.wait()
        step = int(snap.step)
        pk = Packer()
        header = {"kind": "snap", "step": step, "snapshot": pk.tree(dict(snap.state))}
        write_ring_file(self.dir / snap_file(step), header, pk)
        self._snaps.append(step)
        while len(self._snaps) > 2:
            old = self._snaps.pop(0)
            (self.dir / snap_file(old)).unlink(missing_ok=True)
        self._prune()

    def _write_step(self, entry: Any, event: Any) -> None:
        if event is not None:
            event.synchronize()
        step = int(entry.step)
        pk = Packer()
        header: dict[str, Any] = {"kind": "step", "step": step, "record": entry.record,
                                  "batch": pk.tree(entry.batch)}
        if entry.rng is not None:
            from sentineld.contracts.rng import rng_to_json  # noqa: PLC0415

            meta, arrays = rng_to_json(dict(entry.rng))
            header["rng"] = {"meta": meta, "arrays": {k: pk.add(np.asarray(v)) for k, v in arrays.items()}}
        write_ring_file(self.dir / step_file(step), header, pk)
        self._steps.append(step)
        self._prune()

    def _prune(self) -> None:
        oldest = self._snaps[0] if self._snaps else None
        while self._steps and (len(self._steps) > self.window or
                               (oldest is not None and self._steps[0] < oldest)):
            old = self._steps.pop(0)
            (self.dir / step_file(old)).unlink(missing_ok=True)

    # ------------------------------------------------------------ lifetime
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until what is queued now is on disk (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while (self._items or self._busy) and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.002)

    def close(self, remove: bool = True, timeout_s: float = 30.0) -> None:
        """Stop the writer; delete the directory when ``remove`` (a clean end), else leave it for
        :func:`recover_ring`. Releases the lock either way."""
        self._stop = True
        self._wake.put(None)
        self._thread.join(timeout_s)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
