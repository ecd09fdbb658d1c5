"""Ring recovery (the daemon's side of the on-disk ring): a ring directory whose ``lock`` is free
belongs to a dead process; :func:`recover_ring` (run by the daemon on the training host, or
``sentineld recover``) turns it into ``capture-rank<R>-step<N>-crash.h5`` (snapshot S, steps S..N,
records from the step files and the stream), written by the capture writer of
:mod:`sentineld.contracts.capture`, and deletes it. Recovery needs h5py and numpy, not torch.
Format: :mod:`sentineld.contracts.ringformat`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterator

from sentineld.contracts.capture import EncodedStep, write_capture
from sentineld.contracts.ringformat import (
    SNAP_FILE,
    STEP_FILE,
    close_mapping,
    read_ring_file,
    read_ring_meta,
    ring_rng,
    ring_state,
    ring_tree,
    snap_file,
    step_file,
)
from sentineld.contracts.rundir import RunDir, stream_path
from sentineld.contracts.stream import read_stream
from sentineld.contracts.triggers import CRASH

__all__ = ["ring_state", "recover_ring", "recover_run"]

log = logging.getLogger("sentineld.diskring")


def _records_from_stream(run_dir: Path, rank: int, lo: int, hi: int) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    path = stream_path(run_dir, rank)
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
    ring_dir = Path(ring_dir)
    m = RunDir.RING.match(ring_dir.name)
    run_dir = ring_dir.parent
    try:
        if not stat.S_ISDIR(os.lstat(ring_dir).st_mode):
            # A symlink named like a ring: following it would delete files wherever it points.
            log.warning("%s is not a ring directory (a symlink or a file); left alone", ring_dir)
            return None
        fd = os.open(ring_dir / "lock", os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # alive, or another recovery runs
        meta = read_ring_meta(ring_dir)
        try:
            rank = int(meta.get("rank", m.group(1) if m else 0))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            rank = int(m.group(1)) if m else 0
        snaps, steps = set(), set()
        for p in ring_dir.iterdir():
            if p.is_symlink():
                continue  # never ours: the agent writes plain files only
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # cut short by the kill
            elif (sm := SNAP_FILE.match(p.name)):
                snaps.add(int(sm.group(1)))
            elif (st := STEP_FILE.match(p.name)):
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
        path = RunDir(run_dir).capture(rank, last, CRASH)
        if not path.exists():
            _assemble(ring_dir, path, meta, rank, first, last, who)
        shutil.rmtree(ring_dir, ignore_errors=True)
        return path
    finally:
        os.close(fd)


def _assemble(ring_dir: Path, path: Path, meta: dict[str, Any], rank: int, first: int, last: int,
              who: str) -> None:
    """Write snapshot ``first`` and steps ``first..last`` of the ring as a capture, through the one
    capture writer (:func:`sentineld.contracts.capture.write_capture`); one step file is mapped
    at a time."""
    stream_recs = _records_from_stream(path.parent, rank, first, last)
    sources = [ring_dir / snap_file(first)] + [ring_dir / step_file(n) for n in range(first, last + 1)]
    estimate = sum(p.stat().st_size for p in sources)
    records = []
    for n, src in zip(range(first, last + 1), sources[1:]):
        header, body, mm = read_ring_file(src)
        del body
        close_mapping(mm)
        rec = header.get("record")
        rec = rec if isinstance(rec, dict) else stream_recs.get(n)
        if rec is not None:
            records.append(rec)

    def steps() -> Iterator[EncodedStep]:
        for n, src in zip(range(first, last + 1), sources[1:]):
            header, body, mm = read_ring_file(src)
            try:
                rng = header.get("rng")
                yield EncodedStep(n, ring_tree(header["batch"], body), ring_rng(rng, body) if rng else None)
            finally:
                del body
                close_mapping(mm)

    header, body, mm = read_ring_file(sources[0])
    try:
        write_capture(
            path, run_id=str(meta.get("run_id", path.parent.name)), rank=rank, trigger=CRASH,
            first_step=last, snapshot_step=first, snapshot=ring_tree(header["snapshot"], body),
            steps=steps(), records=records, estimate_bytes=estimate,
            torch_version=str(meta.get("torch_version", "")),
            message=(f"process {meta.get('pid', '?')} died without closing the agent (SIGKILL, "
                     f"the OOM killer?); assembled from its on-disk ring by {who}"))
    finally:
        del body
        close_mapping(mm)


def recover_run(run_dir: Path, who: str = "sentineld") -> list[Path]:
    """Recover every dead ring of a run directory; returns the captures written or found."""
    out = []
    for d in sorted(Path(run_dir).glob(f"{RunDir.RING_PREFIX}*")):
        if d.is_dir() and ring_state(d) == "dead":
            p = recover_ring(d, who)
            if p is not None:
                out.append(p)
    return out
