"""The on-disk ring's format (written by ``sentineld.agent.diskring``, read by
``sentineld.daemon.ring_recovery``): the agent's ring buffer persisted as it is taken, so a run killed without
warning (SIGKILL, the OOM killer) still leaves what a crash capture needs.

Layout, one directory per training process (``<run_dir>/ring-rank<R>-<pid>/``)::

    lock                  flock'ed by the writing process for its whole life (the kernel drops
                          it when the process dies, however it dies)
    meta.json             :class:`RingMeta`: run_id, rank, pid, host, torch_version, window
    snap-<S>.ring         snapshot S (the state before step S): one record
    steps-<F>.ring        a segment: the records of steps F, F+1, ... (at most K of them), appended
                          one after the other as the steps are taken

A ``.ring`` file is ``MAGIC`` then records (the codec: :mod:`sentineld.contracts.ringrecord`). A
record is self-delimiting and checked::

    offset 0   REC_MARK "SREC"        4 bytes
           4   header length H        u32 little-endian (at most MAX_RECORD_HEADER)
           8   body length B          u64 little-endian
          16   CRC                    u32 LE: zlib.crc32 of H and B (as packed above) then the header
          20   header                 H bytes of JSON: an object; ``kind`` "step" or "snap", ``step``,
                                      the trees as a capture stores them and, per tensor, its torch
                                      dtype, numpy dtype, shape, offset in the body and size
      20 + H   body                   B bytes: the raw tensor bytes
  20 + H + B   trailer                the CRC again (u32 LE), then REC_END "SEND"

A step record's header holds ``batch`` (a packed tree), ``rng`` (or none) and ``record`` (the
step's stream record when the agent had it, else null: recovery then takes it from the stream).
A snapshot's holds ``snapshot``. The header is checksummed (under 1 us for a step's), the body
is not: a kill only ever cuts a record short (the writes of a killed process stop; nothing comes
after them), which the lengths and the trailer detect, and zlib.crc32 over the body (about 2.9 GB/s
here: 14 us for a 38 kB MLP batch, some 2 ms for a 5 MB image batch) would catch only corruption
no kill produces.

Writing: a segment is created ``O_EXCL | O_NOFOLLOW``, 0600, and each step is one ``os.writev``
run appended to its descriptor, kept open until K records are in it (the writer's choice; the
reader does not need it). Not HDF5 and no file per step: this is the per-step hot path; raw
``writev`` calls copy nothing in Python (they write from the tensors' own memory), release the GIL
while the kernel copies, and fail cleanly on a full disk (the writer then truncates the segment
back to its last whole record and starts a new one). Nothing is fsynced: page-cache writes survive
the death of the process (not of the machine), which keeps the per-step cost low. A snapshot file
(rare, big) is written to ``*.tmp`` and renamed, so it is whole or absent. Bounded on disk like the
RAM ring: the two newest snapshots, and at most ``window`` steps, none older than the older
snapshot, plus what shares a segment with them (a segment is deleted when none of its steps is
needed: at most about ``window + K`` steps).

Reading (``ringrecord.scan_segment``, ``ringrecord.read_ring_file``): ring files are untrusted input (a hostile
local user may have written them). Only regular files are opened, relative to the checked ring
directory; every length and offset is checked against the file before it is used, and every
tensor description against its record's body. A record that runs past the end of its file is the
tail a kill cut short: it and nothing else is ignored. Anything else that is not a record as
written here (no marker, a CRC or trailer that does not match, a header over the limit, not a JSON
object, a tensor outside its body, more than ``MAX_SEGMENT_STEPS`` records in a segment) ends the
reading of that file with a message saying why; the records before it are kept. Bodies are read
as private copies (``ringrecord.private_copy``), never by mapping the ring's own file (its owner
could cut it short under the mapping: SIGBUS) nor into the heap at a length the file gives.

A clean ``close`` deletes the directory. One left behind whose ``lock`` is free belongs to a dead
process: :func:`recover_ring` (run by the daemon on the training host, or ``sentineld recover``)
turns it into ``capture-rank<R>-step<N>-crash.h5`` (snapshot S, steps S..N, records from the step
records and the stream; the capture layout of :mod:`sentineld.contracts.capture`) and deletes it.
Recovery needs h5py and numpy, not torch. The previous layout (``SNTLRING1``: one ``step-<n>.ring``
file per step) is not read: no released ring survives an upgrade of a running process (a ring
lives as long as its process, and is recovered by the daemon of the same install when it dies).
A ring of that layout is reported as an older one and holds nothing to recover.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sentineld.contracts.capture import EncodedRng, EncodedTree
from sentineld.contracts.capture_data import tensor_to_numpy
from sentineld.contracts.safeio import SafeDir, json_depth_ok
from sentineld.contracts.treecodec import encode

__all__ = ["SNAP_FILE", "SEGMENT_FILE", "LOCK_FILE", "META_FILE", "MAX_RING_META_BYTES", "RingMeta",
           "read_ring_meta", "MAX_SEGMENT_STEPS", "segment_steps", "Packer",
           "close_mapping", "ring_array", "ring_tree", "ring_rng", "ring_state",
           "snap_file", "segment_file"]

SNAP_FILE = re.compile(r"^snap-(\d+)\.ring$")
SEGMENT_FILE = re.compile(r"^steps-(\d+)\.ring$")
#: The file its writer keeps flock'ed for its whole life.
LOCK_FILE = "lock"
#: The ring's :class:`RingMeta`.
META_FILE = "meta.json"
#: Largest ``meta.json`` read (the agent writes about 150 bytes; a run id is at most a few hundred).
MAX_RING_META_BYTES = 64 << 10
#: Most step records in one segment file (:func:`segment_steps` never gives more; the reader
#: refuses a segment holding more).
MAX_SEGMENT_STEPS = 32


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


def segment_steps(window: int) -> int:
    """K, the most step records in one segment file: ``window // 4``, within 4..:data:`MAX_SEGMENT_STEPS`.

    A segment costs the kernel's file create, free-space check and unlink once (about 0.9 ms of
    CPU on this project's ext4 VM, what one file per step cost every step): 32 steps spread it to
    ~28 us a step. The bound on disk is about ``window + K`` steps, so K stays at most a quarter of
    the window (default window 256: K = 32, at most 288 steps on disk).
    """
    return max(4, min(MAX_SEGMENT_STEPS, window // 4))


def segment_file(first_step: int) -> str:
    """Name of the segment whose first record is step ``first_step``."""
    return f"steps-{first_step:09d}.ring"


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


def close_mapping(mm: Any) -> None:
    """Close a mapping from :func:`~sentineld.contracts.ringrecord.read_ring_file` (left to the GC while a
    view is alive; None, an empty body's, is nothing to close)."""
    if mm is None:
        return
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


