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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sentineld.contracts.h5write import disk_full_error
from sentineld.contracts.ringformat import (
    LOCK_FILE,
    META_FILE,
    Packer,
    RingMeta,
    segment_file,
    segment_steps,
    snap_file,
)
from sentineld.contracts.ringrecord import MAGIC, encode_record, write_all, write_ring_file
from sentineld.contracts.rundir import RunDir
from sentineld.contracts.safeio import SafeDir, require_free, write_atomic

__all__ = ["DiskRingWriter"]

log = logging.getLogger("sentineld.diskring")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC


@dataclass(eq=False)
class _Segment:
    name: str
    fd: int
    size: int
    count: int = 0


class DiskRingWriter:
    """Persist snapshots and steps under ``run_dir`` from a background thread.

    The training thread only queues references to host copies it already made (bounded queue of
    ``window`` items; when the disk falls behind, items are dropped and counted, never waited
    for). Steps are appended to segment files of :func:`segment_steps` records each, snapshots
    written one file each. One warning is logged for the first write that fails (e.g. a full
    disk); training goes on and later writes are still tried.

    Args:
        run_dir: the run directory.
        rank: this process's rank.
        window: most steps kept on disk (plus those sharing a segment with them: at most
            ``window + segment_steps(window)``).
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
        self._at = SafeDir.open(d)  # every file is made and deleted relative to it (no path re-resolved)
        self.window = window
        #: most step records in one segment (:func:`segment_steps`)
        self.segment_steps = segment_steps(window)
        self.dropped = 0
        self.written = 0
        self.failures = 0
        #: CPU seconds this writer spends on a snapshot file (decaying maximum; 0.0 before the first).
        self.snapshot_cost_s = 0.0
        self._on_warning = on_warning
        self._warned = False
        self._snaps: list[int] = []
        self._steps: deque[tuple[int, _Segment]] = deque()  # on disk, oldest first
        self._segments: deque[_Segment] = deque()  # on disk, oldest first; the last may be open
        self._open: _Segment | None = None
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
        t0 = time.thread_time()
        step = int(snap.step)
        pk = Packer()
        header = {"kind": "snap", "step": step, "snapshot": pk.tree(dict(snap.state))}
        write_ring_file(self._at, snap_file(step), header, pk)
        # This thread's CPU for its snapshot files (a 9.5 MiB MLP + Adam state: ~4.4 ms), as the
        # cadence keeps the copy's: a decaying maximum, so one cheap write does not halve the
        # cadence at once. The cadence counts it against its budget beside the training thread's copy.
        self.snapshot_cost_s = max(self.snapshot_cost_s * 0.5, time.thread_time() - t0)
        self._snaps.append(step)
        while len(self._snaps) > 2:
            self._at.unlink(snap_file(self._snaps.pop(0)))
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
        bufs, size = encode_record(header, pk)
        seg = self._segment(step, size)
        try:
            write_all(seg.fd, bufs)
        except BaseException:
            self._abandon(seg)
            raise
        seg.size += size
        seg.count += 1
        self._steps.append((step, seg))
        self._prune()

    def _segment(self, step: int, size: int) -> _Segment:
        """The open segment, or a new one (named after ``step``) when it holds K records.

        Raises:
            OSError: ``ENOSPC`` when the disk has not room for K records like this one (+ 1 MiB):
                checked once a segment, so a full disk fails here, before any write.
        """
        seg = self._open
        if seg is not None and seg.count < self.segment_steps:
            return seg
        self._close_segment()
        require_free(self._at.fd, self.segment_steps * size + (1 << 20), f"{self.segment_steps} steps", self.dir)
        name = segment_file(step)
        fd = os.open(name, _CREATE, 0o600, dir_fd=self._at.fd)
        seg = _Segment(name, fd, 0)
        self._segments.append(seg)
        self._open = seg
        try:
            write_all(fd, [MAGIC])
        except BaseException:
            self._abandon(seg)
            raise
        seg.size = len(MAGIC)
        return seg

    def _abandon(self, seg: _Segment) -> None:
        """After a failed write: cut ``seg`` back to its last whole record (a later record must
        never follow a partial one) and close it; the next step opens a new segment, checking the
        free space again. Deleted when it holds no record."""
        try:
            os.ftruncate(seg.fd, seg.size)
        except OSError:
            pass  # the reader stops at the partial record: it is the last thing in the file
        self._close_segment()
        if seg.count == 0:
            self._at.unlink(seg.name)
            self._segments.remove(seg)

    def _close_segment(self) -> None:
        seg, self._open = self._open, None
        if seg is not None:
            os.close(seg.fd)
            seg.fd = -1

    def _prune(self) -> None:
        """Forget the steps no longer needed (beyond ``window``, or before the older snapshot);
        delete each closed segment none of whose steps is still needed."""
        oldest = self._snaps[0] if self._snaps else None
        while self._steps and (len(self._steps) > self.window or
                               (oldest is not None and self._steps[0][0] < oldest)):
            self._steps.popleft()
        keep = self._steps[0][1] if self._steps else self._open
        while self._segments and self._segments[0] is not keep and self._segments[0] is not self._open:
            self._at.unlink(self._segments.popleft().name)

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
        if not self._thread.is_alive():  # else it may still be writing: its descriptors stay
            self._close_segment()
            self._at.close()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
