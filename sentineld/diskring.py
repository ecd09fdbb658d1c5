"""The on-disk ring: the agent's ring buffer persisted as it is taken, so a run killed without
warning (SIGKILL, the OOM killer) still leaves what a crash capture needs.

Layout, one directory per training process (``<run_dir>/ring-rank<R>-<pid>/``)::

    lock                  flock'ed by the writing process for its whole life (the kernel drops
                          it when the process dies, however it dies)
    meta.json             run_id, rank, pid, host, torch_version, window
    snap-<S>.ring         snapshot S (the state before step S)
    step-<n>.ring         step n: batch, RNG state, and its record when known

A ``.ring`` file is ``MAGIC``, an 8-byte little-endian header length, a JSON header (the trees
as a capture stores them, and per tensor its torch dtype, numpy dtype, shape, offset and size),
then the raw tensor bytes. Not HDF5: this is the per-step hot path, and raw ``write()`` calls
copy nothing (they write from the tensors' own memory), release the GIL while the kernel copies,
and fail cleanly on a full disk. Each file is written to ``*.tmp`` and renamed, so it is whole or
absent: page-cache writes survive the death of the process (not of the machine; nothing is
fsynced, which keeps the per-step cost low). Bounded on disk like the RAM ring: the two newest
snapshots, and at most ``window`` steps, none older than the older snapshot.

A clean ``close`` deletes the directory. One left behind whose ``lock`` is free belongs to a dead
process: :func:`recover_ring` (run by the daemon on the training host, or ``sentineld recover``)
turns it into ``capture-rank<R>-step<N>-crash.h5`` (snapshot S, steps S..N, records from the step
files and the stream; the capture layout of :mod:`sentineld.contracts.capture`) and deletes it. Recovery
needs h5py and numpy, not torch.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import queue
import re
import shutil
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .capture import SCHEMA_VERSION, _tensor_to_numpy, capture_name, disk_full_error, write_h5_atomic
from .stream import read_stream
from .treecodec import encode

__all__ = ["DiskRingWriter", "ring_state", "recover_ring", "recover_run", "RING_PREFIX"]

log = logging.getLogger("sentineld.diskring")

RING_PREFIX = "ring-rank"
_SNAP = re.compile(r"^snap-(\d+)\.ring$")
_STEP = re.compile(r"^step-(\d+)\.ring$")
MAGIC = b"SNTLRING1\n"


class _Packer:
    """Collects arrays for one ``.ring`` file and describes them for its header."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, arr: np.ndarray) -> list[Any]:
        arr = np.ascontiguousarray(arr)
        desc = [arr.dtype.str, list(arr.shape), self.size, int(arr.nbytes)]
        self.arrays.append(arr)
        self.size += int(arr.nbytes)
        return desc

    def tree(self, tree: Any) -> dict[str, Any]:
        tensors: list[Any] = []
        enc = encode(tree, tensors)
        out = []
        for t in tensors:
            arr, dtype = _tensor_to_numpy(t)
            out.append([dtype, *self.add(arr)])
        return {"tree": enc, "tensors": out}


def _write_ring_file(path: Path, header: dict[str, Any], packer: _Packer) -> None:
    """Write a ``.ring`` file whole or not at all (tmp + rename, 0600, no fsync)."""
    head = json.dumps(header, allow_nan=True).encode()
    need = packer.size + len(head) + (1 << 20)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise OSError(errno.ENOSPC, f"no space left on device in {path.parent} ({free} bytes free, "
                                    f"about {need} needed for {path.name})")
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            for buf in [MAGIC + len(head).to_bytes(8, "little") + head,
                        *(memoryview(a).cast("B") for a in packer.arrays if a.nbytes)]:
                view = memoryview(buf)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_ring_file(path: Path) -> tuple[dict[str, Any], memoryview, Any]:
    """``(header, body, mapping)`` of a ``.ring`` file (close ``mapping`` when done)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if mm[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path.name}: not an on-disk ring file")
        hlen = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        header = json.loads(mm[start:start + hlen])
        if not isinstance(header, dict):
            raise ValueError(f"{path.name}: bad header")
        return header, memoryview(mm)[start + hlen:], mm
    except BaseException:
        mm.close()
        raise


def _close(mm: Any) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass


def _array(body: memoryview, desc: list[Any]) -> np.ndarray:
    np_dtype, shape, off, n = desc
    if off < 0 or n < 0 or off + n > len(body):
        raise ValueError("tensor outside the file")
    return np.frombuffer(body[off:off + n], dtype=np.dtype(np_dtype)).reshape(shape)


def _put_tree(group: Any, packed: dict[str, Any], body: memoryview) -> None:
    """Write a packed tree into an HDF5 group in the capture layout (``tree`` + datasets)."""
    group.create_dataset("tree", data=json.dumps(packed["tree"]))
    for i, (torch_dtype, *desc) in enumerate(packed["tensors"]):
        group.create_dataset(str(i), data=_array(body, desc)).attrs["torch_dtype"] = str(torch_dtype)
_DIR = re.compile(r"^ring-rank(\d+)-(\d+)(?:-\d+)?$")


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
        meta: extra JSON-ready fields for ``meta.json`` (run_id, torch_version, ...).
        on_warning: called once with the warning text (the agent puts it in the stream).

    Raises:
        OSError: the directory or its lock cannot be created.
    """

    def __init__(self, run_dir: Path, rank: int, window: int, meta: dict[str, Any] | None = None,
                 on_warning: Callable[[str], None] | None = None) -> None:
        base = f"{RING_PREFIX}{rank}-{os.getpid()}"
        d, n = run_dir / base, 0
        while d.exists():  # a dead process with our pid left one: keep it for recovery
            n += 1
            d = run_dir / f"{base}-{n}"
        # Built under a hidden name and renamed once locked: a watcher never sees the ring
        # without its lock held (it would take the ring for a dead process's).
        init = run_dir / f".{d.name}.init"
        shutil.rmtree(init, ignore_errors=True)
        init.mkdir(mode=0o700)
        self._lock_fd = os.open(init / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "window": window,
                **(meta or {})}
        fd = os.open(init / "meta.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
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
        pk = _Packer()
        header = {"kind": "snap", "step": step, "snapshot": pk.tree(dict(snap.state))}
        _write_ring_file(self.dir / f"snap-{step:09d}.ring", header, pk)
        self._snaps.append(step)
        while len(self._snaps) > 2:
            old = self._snaps.pop(0)
            (self.dir / f"snap-{old:09d}.ring").unlink(missing_ok=True)
        self._prune()

    def _write_step(self, entry: Any, event: Any) -> None:
        if event is not None:
            event.synchronize()
        step = int(entry.step)
        pk = _Packer()
        header: dict[str, Any] = {"kind": "step", "step": step, "record": entry.record,
                                  "batch": pk.tree(entry.batch)}
        if entry.rng is not None:
            from .rng import rng_to_json  # noqa: PLC0415

            meta, arrays = rng_to_json(dict(entry.rng))
            header["rng"] = {"meta": meta, "arrays": {k: pk.add(np.asarray(v)) for k, v in arrays.items()}}
        _write_ring_file(self.dir / f"step-{step:09d}.ring", header, pk)
        self._steps.append(step)
        self._prune()

    def _prune(self) -> None:
        oldest = self._snaps[0] if self._snaps else None
        while self._steps and (len(self._steps) > self.window or
                               (oldest is not None and self._steps[0] < oldest)):
            old = self._steps.pop(0)
            (self.dir / f"step-{old:09d}.ring").unlink(missing_ok=True)

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


# --------------------------------------------------------------- recovery
def ring_state(ring_dir: Path) -> str:
    """``alive`` (its writer holds the lock), ``dead`` (lock free: the writer is gone) or
    ``unknown`` (no lock file: not a ring, or one still being created)."""
    try:
        fd = os.open(ring_dir / "lock", os.O_RDWR)
    except OSError:
        return "unknown"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return "alive"
        return "unknown"
    finally:
        os.close(fd)
    return "dead"


def _records_from_stream(run_dir: Path, rank: int, lo: int, hi: int) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    path = run_dir / f"stream-rank{rank}.jsonl"
    offset = 0
    try:
        while True:
            objs, new, _bad = read_stream(path, offset, 4 << 20)
            if new == offset:
                break
            offset = new
            for o in objs:
                if o.get("kind") == "step" and isinstance(o.get("step"), int) and lo <= o["step"] <= hi:
                    out[o["step"]] = o
    except OSError:
        pass
    return out


def recover_ring(ring_dir: Path, who: str = "sentineld") -> Path | None:
    """Turn a dead process's ring directory into a ``crash`` capture next to it; delete the ring.

    Returns:
        The capture's path, or None when the writer is alive (the directory stays), or the ring
        holds no snapshot followed by a step (nothing to replay; the directory is deleted).

    Raises:
        OSError: the capture cannot be written (the ring is kept for another try).
    """
    import h5py  # noqa: PLC0415

    ring_dir = Path(ring_dir)
    m = _DIR.match(ring_dir.name)
    run_dir = ring_dir.parent
    try:
        fd = os.open(ring_dir / "lock", os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # alive, or another recovery runs
        try:
            meta = json.loads((ring_dir / "meta.json").read_text())
            meta = meta if isinstance(meta, dict) else {}
        except (OSError, ValueError):
            meta = {}
        try:
            rank = int(meta.get("rank", m.group(1) if m else 0))
        except (TypeError, ValueError):
            rank = int(m.group(1)) if m else 0
        snaps, steps = set(), set()
        for p in ring_dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # cut short by the kill
            elif (sm := _SNAP.match(p.name)):
                snaps.add(int(sm.group(1)))
            elif (st := _STEP.match(p.name)):
                steps.add(int(st.group(1)))
        chosen = None
        for s in sorted(snaps, reverse=True):
            if s in steps:
                last = s
                while last + 1 in steps:
                    last += 1
                chosen = (s, last)
                break
        if chosen is None:
            log.warning("on-disk ring %s holds no snapshot followed by its steps; nothing to recover",
                        ring_dir)
            shutil.rmtree(ring_dir, ignore_errors=True)
            return None
        first, last = chosen
        path = run_dir / capture_name(rank, last, "crash")
        if not path.exists():
            _assemble(h5py, ring_dir, path, meta, rank, first, last, who)
        shutil.rmtree(ring_dir, ignore_errors=True)
        return path
    finally:
        os.close(fd)


def _assemble(h5py: Any, ring_dir: Path, path: Path, meta: dict[str, Any], rank: int, first: int,
              last: int, who: str) -> None:
    stream_recs = _records_from_stream(path.parent, rank, first, last)
    sources = [ring_dir / f"snap-{first:09d}.ring"] + [ring_dir / f"step-{n:09d}.ring" for n in range(first, last + 1)]
    estimate = sum(p.stat().st_size for p in sources)

    def fill(f: Any) -> None:
        f.attrs.update(
            schema_version=SCHEMA_VERSION, run_id=str(meta.get("run_id", path.parent.name)),
            rank=rank, trigger="crash", first_step=last, snapshot_step=first, created_s=time.time(),
            message=(f"process {meta.get('pid', '?')} died without closing the agent (SIGKILL, "
                     f"the OOM killer?); assembled from its on-disk ring by {who}"),
            torch_version=str(meta.get("torch_version", "")))
        header, body, mm = _read_ring_file(sources[0])
        try:
            _put_tree(f.create_group("snapshot"), header["snapshot"], body)
        finally:
            del body
            _close(mm)
        sg = f.create_group("steps")
        records = []
        for n, src in zip(range(first, last + 1), sources[1:]):
            header, body, mm = _read_ring_file(src)
            try:
                g = sg.create_group(str(n))
                _put_tree(g.create_group("batch"), header["batch"], body)
                rng = header.get("rng")
                if rng:
                    g.create_dataset("rng_meta", data=json.dumps(rng["meta"]))
                    rg = g.create_group("rng")
                    for name, desc in rng["arrays"].items():
                        rg.create_dataset(name, data=_array(body, desc))
            finally:
                del body
                _close(mm)
            rec = header.get("record")
            rec = rec if isinstance(rec, dict) else stream_recs.get(n)
            if rec is not None:
                records.append(rec)
        f.create_dataset("records", data=json.dumps(records))

    write_h5_atomic(path, fill, estimate, durable=True, what="crash capture")


def recover_run(run_dir: Path, who: str = "sentineld") -> list[Path]:
    """Recover every dead ring of a run directory; returns the captures written or found."""
    out = []
    for d in sorted(Path(run_dir).glob(f"{RING_PREFIX}*")):
        if d.is_dir() and ring_state(d) == "dead":
            p = recover_ring(d, who)
            if p is not None:
                out.append(p)
    return out
