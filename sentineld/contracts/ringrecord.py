"""The records of the on-disk ring's files: :func:`encode_record` / :func:`write_all` (the agent's
writer), :func:`scan_segment` / :func:`read_record` / :func:`read_body` / :func:`read_ring_file`
(recovery). The layout, and why it is so, is described once, in :mod:`sentineld.contracts.ringformat`;
this module is its byte-level codec, and the reader's checks of files it cannot trust.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sentineld.contracts.ringformat import Packer
from sentineld.contracts.safeio import SafeDir, json_depth_ok, open_regular, require_free

__all__ = ["MAGIC", "REC_MARK", "REC_END", "MAX_RECORD_HEADER", "RingRecord", "SegmentScan", "encode_record",
           "write_all", "write_ring_file", "read_record", "scan_segment", "private_copy", "read_body",
           "read_ring_file"]

#: First bytes of every ``.ring`` file (snapshot or segment).
MAGIC = b"SNTLRING2\n"
_OLD_MAGIC = b"SNTLRING1\n"  # one file per step, before segments
REC_MARK = b"SREC"
REC_END = b"SEND"
_PREFIX = struct.Struct("<4sIQI")  # marker, header length, body length, CRC
_LENGTHS = struct.Struct("<IQ")
_TRAILER = struct.Struct("<I4s")  # CRC, end marker
#: Largest record header read or written. A step's header is a few KiB (its record, the batch's
#: tree, about 60 bytes per tensor); a snapshot's lists every state tensor (about 100 bytes each):
#: 16 MiB is some 150k tensors, and stops a hostile length before it is read.
MAX_RECORD_HEADER = 16 << 20
_IOV_MAX = 1024  # POSIX minimum; Linux's too
_IO_MAX = 1 << 30  # Linux moves at most 0x7ffff000 bytes per read/write call


def _crc(hlen: int, blen: int, head: bytes) -> int:
    return zlib.crc32(head, zlib.crc32(_LENGTHS.pack(hlen, blen)))


def encode_record(header: dict[str, Any], packer: Packer) -> tuple[list[Any], int]:
    """One record as the buffers to write in order (prefix + header, the packer's arrays, the
    trailer; nothing copied but the header) and its size in bytes.

    Raises:
        ValueError: the header's JSON is over :data:`MAX_RECORD_HEADER`.
    """
    head = json.dumps(header, allow_nan=True).encode()
    if len(head) > MAX_RECORD_HEADER:
        raise ValueError(f"a ring record header of {len(head)} bytes is over the {MAX_RECORD_HEADER}-byte limit")
    crc = _crc(len(head), packer.size, head)
    bufs: list[Any] = [_PREFIX.pack(REC_MARK, len(head), packer.size, crc) + head,
                       *(memoryview(a).cast("B") for a in packer.arrays if a.nbytes),  # type: ignore[arg-type]
                       _TRAILER.pack(crc, REC_END)]
    return bufs, _PREFIX.size + len(head) + packer.size + _TRAILER.size


def write_all(fd: int, bufs: list[Any]) -> None:
    """Write ``bufs`` in order at ``fd``'s position: ``os.writev`` until all is written (a call may
    write part; at most ``IOV_MAX`` buffers a call).

    Raises:
        OSError: as ``writev`` (``ENOSPC``, ``EFBIG``...); what was written before stays.
    """
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:i + _IOV_MAX])
        if n == 0:  # never for a regular file with room; do not spin
            raise OSError(errno.EIO, "writev wrote nothing")
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0


def write_ring_file(at: SafeDir, name: str, header: dict[str, Any], packer: Packer) -> None:
    """Write a one-record ``.ring`` file (a snapshot) whole or not at all: the safe writer's temp +
    rename in ``at``, 0600, no fsync.

    Raises:
        OSError: ``ENOSPC`` when the free space is under the file's size + 1 MiB (checked first,
            so a full disk fails before writing), or as the write.
    """
    bufs, size = encode_record(header, packer)
    require_free(at.fd, size + len(MAGIC) + (1 << 20), name, at.path)
    with at.create(name, durable=False) as f:
        write_all(f.fileno(), [MAGIC, *bufs])


@dataclass(frozen=True)
class RingRecord:
    """A record found whole in a ``.ring`` file: its header (checked), where its body lies in the
    file (``body_at``, ``body_len`` bytes) and the offset just after it (``end``)."""

    header: dict[str, Any]
    body_at: int
    body_len: int
    end: int
    #: the offset of the record's first byte (its marker)
    start: int = 0


def _pread(fd: int, n: int, at: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, _IO_MAX), at + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_desc(desc: Any, blen: int) -> None:
    """An array description (numpy dtype, shape, offset, size) that lies inside a body of ``blen``."""
    if not (isinstance(desc, list) and len(desc) == 4):
        raise ValueError("a tensor description is not [dtype, shape, offset, size]")
    dt, shape, off, n = desc
    try:
        dtype = np.dtype(dt) if isinstance(dt, str) and len(dt) <= 8 else None
    except Exception:  # noqa: BLE001 - numpy's parser raises TypeError, ValueError, SyntaxError...
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.hasobject:
        raise ValueError(f"a tensor has dtype {str(dt)[:40]!r}, not a plain numeric numpy dtype")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d) and d >= 0 for d in shape)):
        raise ValueError("a tensor's shape is not a list of sizes")
    if not (_is_int(off) and _is_int(n) and off >= 0 and n == math.prod(shape) * dtype.itemsize):
        raise ValueError("a tensor's offset or size does not match its shape")
    if off + n > blen:
        raise ValueError(f"a tensor lies outside its record's body ({off}+{n} bytes of {blen})")


def _check_packed(packed: Any, blen: int, what: str) -> None:
    if not (isinstance(packed, dict) and "tree" in packed and isinstance(packed.get("tensors"), list)):
        raise ValueError(f"{what} is not a packed tree")
    for t in packed["tensors"]:
        if not (isinstance(t, list) and len(t) == 5 and isinstance(t[0], str)):
            raise ValueError(f"a tensor of {what} is not [torch dtype, numpy dtype, shape, offset, size]")
        _check_desc(t[1:], blen)


def _check_header(header: Any, blen: int) -> None:
    """What the reader uses of a header is there, of its type, and inside the body."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    kind, step = header.get("kind"), header.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ValueError("the header has no step number")
    if kind == "snap":
        _check_packed(header.get("snapshot"), blen, "the snapshot")
    elif kind == "step":
        _check_packed(header.get("batch"), blen, "the batch")
        rng = header.get("rng")
        if rng is not None:
            if not (isinstance(rng, dict) and "meta" in rng and isinstance(rng.get("arrays"), dict)):
                raise ValueError("the RNG state is not {meta, arrays}")
            for desc in rng["arrays"].values():
                _check_desc(desc, blen)
    else:
        raise ValueError(f"the record's kind is {str(kind)[:40]!r}, not step or snap")


def read_record(fd: int, at: int, size: int, name: str) -> RingRecord | None:
    """The record at offset ``at`` of a ``.ring`` file of ``size`` bytes open at ``fd``.

    Returns:
        The record, or None when it runs past the end of the file (the tail a kill cut short:
        its prefix or header is incomplete, or its header is whole and checks out but the body
        or trailer is not all there).

    Raises:
        ValueError: not a record as written by :func:`encode_record` (the message says which
            file, where, and why).
    """
    raw = _pread(fd, _PREFIX.size, at) if size - at >= _PREFIX.size else b""
    if len(raw) < _PREFIX.size:
        return None
    mark, hlen, blen, crc = _PREFIX.unpack(raw)
    where = f"{name} at byte {at}"
    if mark != REC_MARK:
        raise ValueError(f"{where}: no record marker")
    if hlen > MAX_RECORD_HEADER:
        raise ValueError(f"{where}: a header of {hlen} bytes, over the {MAX_RECORD_HEADER}-byte limit")
    body_at = at + _PREFIX.size + hlen
    if body_at > size:
        return None
    head = _pread(fd, hlen, at + _PREFIX.size)
    if len(head) < hlen:
        return None
    if _crc(hlen, blen, head) != crc:
        raise ValueError(f"{where}: the header's CRC does not match (lengths {hlen} + {blen})")
    end = body_at + blen + _TRAILER.size
    if end > size:
        return None
    if _pread(fd, _TRAILER.size, end - _TRAILER.size) != _TRAILER.pack(crc, REC_END):
        raise ValueError(f"{where}: no trailer where the record's lengths say it ends (byte {end})")
    if not json_depth_ok(head):
        raise ValueError(f"{where}: the header nests too deeply")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise ValueError(f"{where}: the header is not JSON ({exc})") from None
    try:
        _check_header(header, blen)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return RingRecord(header, body_at, blen, end, at)


@dataclass
class SegmentScan:
    """What :func:`scan_segment` found: the whole records in order, and why the reading stopped
    before the end of the file: ``cut`` (the last record was cut short: expected after a kill) or
    ``damaged`` (something not written by sentineld; the rest of the file is not read)."""

    records: list[RingRecord]
    cut: str | None = None
    damaged: str | None = None


def _check_magic(fd: int, name: str) -> str | None:
    magic = _pread(fd, len(MAGIC), 0)
    if magic == MAGIC:
        return None
    if magic == _OLD_MAGIC:
        return f"{name}: written by an older sentineld (one file per step), a layout no longer read"
    if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
        return ""
    return f"{name}: not an on-disk ring file"


def scan_segment(f: BinaryIO, name: str, max_records: int | None = None) -> SegmentScan:
    """The whole records of a ``.ring`` file open as ``f`` (from ``SafeDir.open_regular``), from
    the first until the end of the file, a record cut short, or one that is not a record.

    Args:
        max_records: more records than this is damage (recovery passes ``MAX_SEGMENT_STEPS``: a
            planted segment of millions of tiny records must not become a list of millions).
    """
    fd = f.fileno()
    size = os.fstat(fd).st_size
    bad = _check_magic(fd, name)
    if bad is not None:
        return SegmentScan([], cut=f"{name}: cut short before its first record") if bad == "" else \
            SegmentScan([], damaged=bad)
    out: list[RingRecord] = []
    at = len(MAGIC)
    while at < size:
        try:
            rec = read_record(fd, at, size, name)
        except ValueError as exc:
            return SegmentScan(out, damaged=str(exc))
        if rec is None:
            return SegmentScan(out, cut=f"{name}: the record at byte {at} runs past the end of the file (cut "
                                        "short: its process died writing it); ignored")
        if max_records is not None and len(out) == max_records:
            return SegmentScan(out, damaged=f"{name}: more than {max_records} records at byte {at}, more than "
                                            "the agent writes in a segment")
        out.append(rec)
        at = rec.end
    return SegmentScan(out)


def private_copy(fd: int, at: int, length: int, name: str) -> tuple[memoryview, Any]:
    """``(view, mapping)`` of bytes ``at .. at + length`` of the untrusted file open at ``fd``,
    copied by the kernel (``sendfile``) into an unlinked temp file only this process can reach,
    and mapped from there (close ``mapping`` with ``ringformat.close_mapping`` when done).

    Why a copy: mapping the ring's own file let its owner cut it short while the capture was
    being written, and a read past the new end of a mapping is SIGBUS, which kills the daemon
    (no exception to catch); reading a body into the heap let a sparse file's length (a
    terabyte that costs its owner no disk) make the daemon allocate it. The copy costs disk on
    the temp dir's file system, checked first, and page cache the kernel can reclaim.

    Raises:
        ValueError: the file no longer holds the whole range (it changed while being read).
        OSError: no room for the copy in the temp dir (``errno.ENOSPC``, with the sizes).
    """
    import tempfile  # noqa: PLC0415

    tmpdir = tempfile.gettempdir()
    require_free(tmpdir, length + (1 << 20), f"a private copy of {length} bytes of {name}")
    out = tempfile.TemporaryFile(dir=tmpdir)  # O_TMPFILE where it can: never has a name
    try:
        got = 0
        while got < length:
            n = os.sendfile(out.fileno(), fd, at + got, min(length - got, _IO_MAX))
            if n == 0:
                break
            got += n
        if got != length:
            raise ValueError(f"{name}: changed while being read ({length} bytes at byte {at}, {got} there)")
        if length == 0:
            return memoryview(b""), None
        mm = mmap.mmap(out.fileno(), length, access=mmap.ACCESS_READ)
    finally:
        out.close()  # the mapping keeps the unlinked file alive
    return memoryview(mm), mm


def read_body(fd: int, rec: RingRecord, name: str) -> tuple[memoryview, Any]:
    """``(body, mapping)`` of ``rec`` from the ring file open at ``fd``: a private copy
    (:func:`private_copy`), never the ring's own file mapped nor its length taken into the heap.

    Raises:
        ValueError: the file no longer holds the whole body.
        OSError: no room for the copy.
    """
    return private_copy(fd, rec.body_at, rec.body_len, name)


def read_ring_file(path: Path, at: SafeDir | None = None) -> tuple[dict[str, Any], memoryview, Any]:
    """``(header, body, mapping)`` of a one-record ``.ring`` file (a snapshot; close ``mapping``
    when done). The body is a mapped private copy (:func:`private_copy`): a snapshot can be as big
    as the model's state, and its owner could cut the ring's own file short under a mapping.

    Args:
        at: the ring directory, opened and checked (recovery); None opens ``path``'s folder.
            Either way only a regular file is opened, never a link or FIFO.

    Raises:
        ValueError: not a whole record as :func:`encode_record` writes it (the message says why),
            or the file changed while being read.
        OSError: no room for the copy.
    """
    f = open_regular(path) if at is None else at.open_regular(path.name)
    with f:
        scan = scan_segment(f, path.name, 1)  # one record: a snapshot
        if not scan.records:
            raise ValueError(scan.damaged or scan.cut or f"{path.name}: holds no record")
        rec = scan.records[0]
        body, mm = private_copy(f.fileno(), rec.body_at, rec.body_len, path.name)
    return rec.header, body, mm
