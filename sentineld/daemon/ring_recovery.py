"""Ring recovery (the daemon's side of the on-disk ring): a ring directory whose ``lock`` is free
belongs to a dead process; :func:`recover_ring` (run by the daemon on the training host, or
``sentineld recover``) turns it into ``capture-rank<R>-step<N>-crash.h5`` (snapshot S, steps S..N,
records from the step records and the stream), written by the capture writer of
:mod:`sentineld.contracts.capture`, and deletes it. Recovery needs h5py and numpy, not torch.
Format: :mod:`sentineld.contracts.ringformat`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from sentineld.contracts.capture import EncodedStep, write_capture
from sentineld.contracts.ringformat import (
    LOCK_FILE,
    MAX_SEGMENT_STEPS,
    SEGMENT_FILE,
    SNAP_FILE,
    RingMeta,
    close_mapping,
    read_ring_meta,
    ring_rng,
    ring_state,
    ring_tree,
    snap_file,
)
from sentineld.contracts.ringrecord import RingRecord, read_body, read_record, read_ring_file, scan_segment
from sentineld.contracts.rundir import RunDir, stream_path
from sentineld.contracts.safeio import SafeDir, UnsafeDirError
from sentineld.contracts.stream import read_stream
from sentineld.contracts.triggers import CRASH

__all__ = ["ring_state", "recover_ring", "recover_run"]

log = logging.getLogger("sentineld.diskring")


def _records_from_stream(run: SafeDir, rank: int, lo: int, hi: int) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    path = stream_path(run.path, rank)
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


def _open_ring(ring_dir: Path) -> tuple[SafeDir, SafeDir] | None:
    """The run dir and the ring dir, opened by descriptor; None when the run dir is gone.

    Raises:
        UnsafeDirError: the ring is not one its run's owner wrote for itself (a link, another
            owner's, or writable by others); it is left alone.
    """
    try:
        run = SafeDir.open(ring_dir.parent, follow=True)
    except OSError:
        return None
    try:
        ring = SafeDir.open(ring_dir, parent=run, owners=(run.st.st_uid,), private=True)
    except OSError as exc:
        run.close()
        raise UnsafeDirError(errno.EPERM, f"{ring_dir} is not an on-disk ring sentineld can trust "
                                          f"({exc}); left alone") from None
    return run, ring


def recover_ring(ring_dir: Path, who: str = "sentineld") -> Path | None:
    """Turn a dead process's ring directory into a ``crash`` capture next to it; delete the ring.

    Every file is opened relative to the run dir's and the ring dir's descriptors, never by a path
    another user could re-point: no link is followed, only regular files are read (a FIFO never
    blocks), and the capture is written by the safe writer (an ``O_EXCL`` temp file of an
    unpredictable name, renamed within the run dir), so a planted ``*.h5.tmp`` link is never
    written through and an existing capture is never replaced.

    Returns:
        The capture's path, or None when the writer is alive (the directory stays), or it holds
        no snapshot followed by a step (nothing to replay; the directory is deleted).

    Raises:
        OSError: the capture cannot be written (the ring is kept for another try);
            ``UnsafeDirError``: the ring cannot be trusted (left alone).
    """
    ring_dir = Path(ring_dir)
    opened = _open_ring(ring_dir)
    if opened is None:
        return None
    run, ring = opened
    with run, ring:
        try:
            fd = os.open(LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=ring.fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None  # alive, or another recovery runs
            return _recover_locked(run, ring, ring_dir, who)
        finally:
            os.close(fd)


class _StepRef(NamedTuple):
    """Where a step's record lies: the segment's name and the record found in it (the file is
    closed again after the scan, and reopened and checked again when the step is read)."""

    name: str
    rec: RingRecord


#: Most segment files one ring's recovery scans: the agent keeps about window / K + 2 (K =
#: ``segment_steps(window)``: 10 at the default window 256); more is not a ring the agent wrote,
#: and a listing of thousands of planted files must not cost the daemon a descriptor or a scan each.
MAX_SEGMENTS = 512
#: Most header bytes of step records kept while a ring is recovered (the agent writes a few KiB a
#: step, ~1 MiB for a whole window): parsed JSON takes several times its text, so headers of
#: planted records up to MAX_RECORD_HEADER each must not add up in the daemon's memory.
MAX_STEP_HEADERS = 64 << 20


def _index_segments(ring: SafeDir, names: list[str]) -> dict[int, _StepRef]:
    """Every whole step record of the segments ``names``, by step; a step found twice is the one
    in the segment of the higher first step. A segment cut short (the kill) or damaged (not
    written by sentineld) gives the records before that point. Each file is open only while it is
    scanned.

    Raises:
        ValueError: more than :data:`MAX_SEGMENTS` segments, or step headers over
            :data:`MAX_STEP_HEADERS` in all: not a ring the agent wrote (left for a person).
    """
    if len(names) > MAX_SEGMENTS:
        raise ValueError(f"{len(names)} segment files, more than the {MAX_SEGMENTS} an agent's ring ever holds")
    steps: dict[int, _StepRef] = {}
    kept = 0
    for name in sorted(names, key=lambda n: int(SEGMENT_FILE.match(n).group(1))):  # type: ignore[union-attr]
        try:
            with ring.open_regular(name) as f:
                scan = scan_segment(f, name, MAX_SEGMENT_STEPS)
        except OSError as exc:
            log.warning("on-disk ring %s: %s not read: %s", ring.path, name, exc)
            continue
        if scan.damaged:
            log.warning("on-disk ring %s: %s; the rest of that file is not read", ring.path, scan.damaged)
        elif scan.cut:
            log.info("on-disk ring %s: %s", ring.path, scan.cut)
        for rec in scan.records:
            if rec.header["kind"] == "step":
                kept += rec.body_at - rec.start  # the record's prefix and JSON header
                steps[rec.header["step"]] = _StepRef(name, rec)
        if kept > MAX_STEP_HEADERS:
            raise ValueError(f"step records with more than {MAX_STEP_HEADERS} bytes of headers: not an agent's ring")
    return steps


def _read_step(ring: SafeDir, ref: _StepRef) -> tuple[memoryview, Any]:
    """``(body, mapping)`` of a step indexed by :func:`_index_segments`: its segment reopened,
    the record read again at the same place and required to be the same (a file swapped or
    rewritten since the scan is an error, not another step's data), the body a private copy.

    Raises:
        ValueError: the segment changed since it was scanned.
    """
    with ring.open_regular(ref.name) as f:
        fd = f.fileno()
        again = read_record(fd, ref.rec.start, os.fstat(fd).st_size, ref.name)
        if again != ref.rec:
            raise ValueError(f"{ref.name}: changed since recovery read it (step {ref.rec.header.get('step')})")
        return read_body(fd, ref.rec, ref.name)


def _snapshot_ok(ring: SafeDir, step: int) -> int | None:
    """Snapshot ``step``'s file size when it holds one whole snapshot record of that step, else None (logged)."""
    name = snap_file(step)
    try:
        with ring.open_regular(name) as f:
            scan = scan_segment(f, name, 1)  # a snapshot file holds one record
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        why = str(exc)
    else:
        head = scan.records[0].header if scan.records else {}
        if head.get("kind") == "snap" and head.get("step") == step:
            return size
        why = scan.damaged or scan.cut or "not a snapshot of that step"
    log.warning("on-disk ring %s: snapshot %s not usable: %s", ring.path, name, why)
    return None


def _recover_locked(run: SafeDir, ring: SafeDir, ring_dir: Path, who: str) -> Path | None:
    m = RunDir.RING.match(ring_dir.name)
    meta = read_ring_meta(ring)
    rank = meta.rank if meta.rank is not None else int(m.group(1)) if m else 0
    snaps, segments = set(), []
    for name in ring.names():
        try:
            st = ring.lstat(name)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # never ours: the agent writes plain files only
        if name.endswith(".tmp"):
            ring.unlink(name)  # cut short by the kill
        elif (sm := SNAP_FILE.match(name)):
            snaps.add(int(sm.group(1)))
        elif SEGMENT_FILE.match(name):
            segments.append(name)
    steps = _index_segments(ring, segments)
    chosen = None
    for s in sorted(snaps, reverse=True):
        if s in steps and (snap_size := _snapshot_ok(ring, s)) is not None:
            last = s
            while last + 1 in steps:
                last += 1
            chosen = (s, last, snap_size)
            break
    if chosen is None:
        log.warning("on-disk ring %s holds no snapshot followed by its steps; nothing to recover", ring_dir)
        _remove_ring(run, ring_dir.name)
        return None
    first, last, snap_size = chosen
    path = RunDir(ring_dir.parent).capture(rank, last, CRASH)
    try:
        run.lstat(path.name)
    except FileNotFoundError:
        _assemble(run, ring, path, meta, rank, [steps[n] for n in range(first, last + 1)], first, who,
                  snap_size)
    _remove_ring(run, ring_dir.name)
    return path


def _remove_ring(run: SafeDir, name: str) -> None:
    """Delete ring dir ``name`` of ``run`` (fd-based: never follows a link, never leaves the run dir)."""
    shutil.rmtree(name, ignore_errors=True, dir_fd=run.fd)


def _assemble(run: SafeDir, ring: SafeDir, path: Path, meta: RingMeta, rank: int, refs: list[_StepRef],
              first: int, who: str, snap_size: int) -> None:
    """Write snapshot ``first`` and the steps of ``refs`` (``first``, ``first + 1``...) as a capture,
    through the one capture writer (:func:`sentineld.contracts.capture.write_capture`) into the
    open run dir; every body is a private copy of the ring's bytes
    (:func:`~sentineld.contracts.ringrecord.private_copy`: a ring file its owner cuts short
    meanwhile raises ``ValueError``, never faults a mapping of hers), one step's at a time."""
    last = first + len(refs) - 1
    stream_recs = _records_from_stream(run, rank, first, last)
    records = []
    for n, ref in enumerate(refs, first):
        rec = ref.rec.header.get("record")
        rec = rec if isinstance(rec, dict) else stream_recs.get(n)
        if rec is not None:
            records.append(rec)

    def steps() -> Iterator[EncodedStep]:
        for n, ref in enumerate(refs, first):
            header = ref.rec.header
            body, mapping = _read_step(ring, ref)
            try:
                rng = header.get("rng")
                yield EncodedStep(n, ring_tree(header["batch"], body), ring_rng(rng, body) if rng else None)
            finally:
                del body
                close_mapping(mapping)

    header, body, mm = read_ring_file(ring.path / snap_file(first), ring)
    try:
        write_capture(
            path, run_id=meta.run_id if meta.run_id is not None else path.parent.name, rank=rank, trigger=CRASH,
            first_step=last, snapshot_step=first, snapshot=ring_tree(header["snapshot"], body),
            steps=steps(), records=records, estimate_bytes=snap_size + sum(r.rec.body_len for r in refs),
            torch_version=meta.torch_version or "", at=run,
            message=(f"process {'?' if meta.pid is None else meta.pid} died without closing the agent (SIGKILL, "
                     f"the OOM killer?); assembled from its on-disk ring by {who}"))
    finally:
        del body
        close_mapping(mm)


def recover_run(run_dir: Path, who: str = "sentineld") -> list[Path]:
    """Recover every dead ring of a run directory; returns the captures written or found."""
    out = []
    for d in RunDir(run_dir).ring_dirs():
        if ring_state(d) == "dead":
            p = recover_ring(d, who)
            if p is not None:
                out.append(p)
    return out
