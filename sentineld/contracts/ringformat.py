"""The on-disk ring's format (written by ``sentineld.agent.diskring``, read by
``sentineld.daemon.ring_recovery``): the agent's ring buffer persisted as it is taken, so a run killed without
warning (SIGKILL, the OOM killer) still leaves what a crash capture needs.

Layout, one directory per training process (``<run_dir>/ring-rank<R>-<pid>/``)::

    lock                  flock'ed by the writing process for its whole life (the kernel drops
                          it when the process dies, however it dies)
    meta.json             :class:`RingMeta`: run_id, rank, pid, host, torch_version, window
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
import mmap
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sentineld.contracts.capture import EncodedRng, EncodedTree
from sentineld.contracts.capture_data import tensor_to_numpy
from sentineld.contracts.safeio import SafeDir, json_depth_ok, open_regular
from sentineld.contracts.treecodec import encode

__all__ = ["SNAP_FILE", "STEP_FILE", "MAGIC", "LOCK_FILE", "META_FILE", "MAX_RING_META_BYTES", "RingMeta",
           "read_ring_meta", "Packer", "write_ring_file",
           "read_ring_file", "close_mapping", "ring_array", "ring_tree", "ring_rng", "ring_state", "snap_file",
           "step_file"]

SNAP_FILE = re.compile(r"^snap-(\d+)\.ring$")
STEP_FILE = re.compile(r"^step-(\d+)\.ring$")
MAGIC = b"SNTLRING1\n"
#: The file its writer keeps flock'ed for its whole life.
LOCK_FILE = "lock"
#: The ring's :class:`RingMeta`.
META_FILE = "meta.json"
#: Largest ``meta.json`` read (the agent writes about 150 bytes; a run id is at most a few hundred).
MAX_RING_META_BYTES = 64 << 10


@dataclass(frozen=True)
class RingMeta:
    """``meta.json``: which process writes the ring (written once, before the ring is visible).

    A field is None when a file read back lacks it or holds another type (a ring a crash cut
    short, or one another sentineld release wrote): the reader falls back to what the ring's
    directory name and the run dir say.
    """

    rank: int | None = None
    pid: int | None = None
    #: ``socket.gethostname()`` of the writer: only the daemon on that host can see its lock.
    host: str | None = None
    #: most steps the ring keeps on disk
    window: int | None = None
    run_id: str | None = None
    torch_version: str | None = None

    def to_json(self) -> str:
        """The file's text (a JSON object; None fields omitted)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, data: bytes | str) -> RingMeta:
        """Parse ``meta.json``'s text; a field of the wrong type reads as None.

        Raises:
            ValueError: not JSON, nested deeper than a meta file can be, or not an object.
        """
        if not json_depth_ok(data):
            raise ValueError(f"{META_FILE} nests too deeply; not a file sentineld wrote")
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"{META_FILE} is not a JSON object")
        def num(name: str) -> int | None:
            v = obj.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def text(name: str) -> str | None:
            v = obj.get(name)
            return v if isinstance(v, str) else None
        return cls(rank=num("rank"), pid=num("pid"), host=text("host"), window=num("window"),
                   run_id=text("run_id"), torch_version=text("torch_version"))


def read_ring_meta(ring: SafeDir) -> RingMeta:
    """The ring's ``meta.json`` (every field None when absent, not a regular file, too big or not
    an object), through the safe reader: a FIFO or a link there never blocks or redirects us."""
    try:
        return RingMeta.from_json(ring.read(META_FILE, MAX_RING_META_BYTES))
    except (OSError, ValueError):
        return RingMeta()


def snap_file(step: int) -> str:
    """Name of snapshot ``step``'s file inside a ring directory."""
    return f"snap-{step:09d}.ring"


def step_file(step: int) -> str:
    """Name of step ``step``'s file inside a ring directory."""
    return f"step-{step:09d}.ring"


class Packer:
    """Collects arrays for one ``.ring`` file and describes them for its header."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, arr: np.ndarray) -> list[Any]:
        shape = list(np.shape(arr))  # before ascontiguousarray, which makes a 0-d array 1-d
        arr = np.ascontiguousarray(arr)
        desc = [arr.dtype.str, shape, self.size, int(arr.nbytes)]
        self.arrays.append(arr)
        self.size += int(arr.nbytes)
        return desc

    def tree(self, tree: Any) -> dict[str, Any]:
        tensors: list[Any] = []
        enc = encode(tree, tensors)
        out = []
        for t in tensors:
            arr, dtype = tensor_to_numpy(t)
            out.append([dtype, *self.add(arr)])
        return {"tree": enc, "tensors": out}


def write_ring_file(path: Path, header: dict[str, Any], packer: Packer) -> None:
    """Write a ``.ring`` file whole or not at all (the safe writer's temp + rename, 0600, no fsync)."""
    head = json.dumps(header, allow_nan=True).encode()
    need = packer.size + len(head) + (1 << 20)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise OSError(errno.ENOSPC, f"no space left on device in {path.parent} ({free} bytes free, "
                                    f"about {need} needed for {path.name})")
    bufs: list[Any] = [MAGIC + len(head).to_bytes(8, "little") + head,
                       *(memoryview(a).cast("B") for a in packer.arrays if a.nbytes)]  # type: ignore[arg-type]
    with SafeDir.open(path.parent) as d, d.create(path.name, durable=False) as f:
        fd = f.fileno()
        for buf in bufs:
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view):]


def read_ring_file(path: Path, at: SafeDir | None = None) -> tuple[dict[str, Any], memoryview, Any]:
    """``(header, body, mapping)`` of a ``.ring`` file (close ``mapping`` when done).

    Args:
        at: the ring directory, opened and checked (recovery); None opens ``path``'s folder.
            Either way only a regular file is opened, never a link or FIFO.
    """
    if at is None:
        f = open_regular(path)
    else:
        f = at.open_regular(path.name)
    with f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if mm[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path.name}: not an on-disk ring file")
        hlen = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        if hlen > len(mm) - start or not json_depth_ok(mm[start:start + hlen]):
            raise ValueError(f"{path.name}: bad header")
        header = json.loads(mm[start:start + hlen])
        if not isinstance(header, dict):
            raise ValueError(f"{path.name}: bad header")
        return header, memoryview(mm)[start + hlen:], mm
    except BaseException:
        mm.close()
        raise


def close_mapping(mm: Any) -> None:
    """Close a mapping from :func:`read_ring_file` (left to the GC while a view is alive)."""
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass


def ring_array(body: memoryview, desc: list[Any]) -> np.ndarray:
    """The array ``desc`` (numpy dtype, shape, offset, size) describes in a ring file's body.

    Raises:
        ValueError: the description points outside the body.
    """
    np_dtype, shape, off, n = desc
    if off < 0 or n < 0 or off + n > len(body):
        raise ValueError("tensor outside the file")
    return np.frombuffer(body[off:off + n], dtype=np.dtype(np_dtype)).reshape(shape)


def ring_tree(packed: dict[str, Any], body: memoryview) -> EncodedTree:
    """A packed tree of a ring file (``Packer.tree``) as the capture writer takes it; its arrays
    are views of ``body`` (keep the mapping open until the capture is written).

    Raises:
        ValueError: a tensor's description points outside the body.
    """
    return EncodedTree(packed["tree"], [(ring_array(body, desc), str(torch_dtype))
                                        for torch_dtype, *desc in packed["tensors"]])


def ring_rng(packed: dict[str, Any], body: memoryview) -> EncodedRng:
    """A step file's RNG state (``header["rng"]``) as the capture writer takes it."""
    return EncodedRng(packed["meta"], {name: ring_array(body, desc) for name, desc in packed["arrays"].items()})


def ring_state(ring_dir: Path) -> str:
    """``alive`` (its writer holds the lock), ``dead`` (lock free: the writer is gone) or
    ``unknown`` (no lock file: not a ring, or one still being created)."""
    try:  # read-only, no link, never blocking: flock needs no write access, a FIFO is no lock
        fd = os.open(ring_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "unknown"
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
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


