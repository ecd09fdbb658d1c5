"""The per-rank metrics stream: JSON lines appended by the agent, tailed by the daemon.

Each line is one JSON object with a ``kind``: ``start`` (pid, host), ``step`` (a StepRecord),
``capture`` (a capture file was written), ``end`` (training finished or crashed) or
``agent_error`` (the agent disabled itself). Floats may be NaN/Infinity (Python's json dialect).

Why JSON lines and not an HDF5 SWMR file: a line written with one ``write()`` survives SIGKILL of
the writer (it is in the page cache), needs no recovery tool, and a reader can skip a torn last line.
An HDF5 writer killed mid-flush leaves a file that needs ``h5clear`` (ecosystem-facts section 5).

The writer never runs I/O on the training thread: :class:`StreamWriter` queues lines and a daemon
thread appends them every ``flush_s`` seconds, so SIGKILL loses at most the last ``flush_s``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

from sentineld.contracts.safeio import open_regular

__all__ = ["StreamWriter", "read_stream", "StreamTail", "read_lines", "CHUNK_BYTES", "MAX_LINE_BYTES"]

log = logging.getLogger("sentineld.stream")

#: Lines kept in memory while the disk refuses writes; older ones are dropped (and counted).
MAX_PENDING_LINES = 100_000


class StreamWriter:
    """Append JSON lines to ``path`` from a background thread.

    :meth:`put` takes no lock (a deque append and, when urgent, a ``SimpleQueue`` token), so it
    is safe from a signal handler that interrupted another ``put`` on the same thread (the
    agent's SIGTERM path).

    Args:
        path: the stream file (created 0600, appended to).
        flush_s: seconds between writes; also the most a SIGKILL can lose.

    Raises:
        ValueError: ``flush_s`` is not positive.
    """

    def __init__(self, path: str | os.PathLike[str], flush_s: float = 1.0) -> None:
        if not flush_s > 0:
            raise ValueError(f"flush_s must be > 0 seconds, got {flush_s!r}")
        self.path = Path(path)
        self.flush_s = flush_s
        self.dropped_lines = 0
        self._pending: deque[str] = deque()
        self._carry = ""  # bytes the disk refused, written first next time (writer side only)
        self._io_lock = threading.RLock()  # writers only: the thread, flush() and close()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._stop = False
        self._warned = False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)  # never a link
        self._thread = threading.Thread(target=self._run, name="sentineld-stream", daemon=True)
        self._thread.start()

    def put(self, obj: dict[str, Any], urgent: bool = False) -> None:
        """Queue one object; ``urgent`` wakes the writer now (incidents should reach the daemon fast)."""
        self._pending.append(json.dumps(obj, separators=(",", ":")) + "\n")
        if len(self._pending) > MAX_PENDING_LINES:
            try:
                self._pending.popleft()
                self.dropped_lines += 1
            except IndexError:
                pass
        if urgent:
            self._wake.put(None)

    def flush(self) -> None:
        """Write everything queued now, on the calling thread."""
        with self._io_lock:
            parts = [self._carry]
            while True:
                try:
                    parts.append(self._pending.popleft())
                except IndexError:
                    break
            data = "".join(parts).encode()
            self._carry = ""
            if not data:
                return
            try:
                # One write per batch of whole lines: a reader never sees half of an earlier line.
                while data:
                    n = os.write(self._fd, data)
                    data = data[n:]
            except OSError as exc:
                kept = data.decode(errors="replace")
                if len(kept) > MAX_PENDING_LINES * 512:  # bound what a full disk makes us hold
                    cut = kept.find("\n", len(kept) - MAX_PENDING_LINES * 512)
                    self.dropped_lines += kept.count("\n", 0, cut + 1)
                    kept = kept[cut + 1:]
                self._carry = kept
                if not self._warned:
                    self._warned = True
                    log.warning("sentineld: cannot write metrics stream %s (%s); keeping up to %d "
                                "lines in memory and retrying", self.path, exc, MAX_PENDING_LINES)

    def _run(self) -> None:
        while not self._stop:
            try:
                self._wake.get(timeout=self.flush_s)
            except queue.Empty:
                pass
            self.flush()

    def close(self) -> None:
        """Flush what is queued, stop the thread and close the file."""
        self._stop = True
        self._wake.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.flush()
        try:
            os.close(self._fd)
        except OSError:
            pass


#: Most bytes one :func:`read_stream` call reads by default, so a daemon catching up on a long
#: stream holds a bounded slice of it in memory (a 1M-step stream is a few hundred MB).
CHUNK_BYTES = 1 << 20

#: A line longer than this is skipped as damaged (a step record is well under 64 KiB).
MAX_LINE_BYTES = 16 << 20


def _parse(raw: bytes) -> dict[str, Any] | None:
    if len(raw) > MAX_LINE_BYTES:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def read_lines(path: str | os.PathLike[str], offset: int = 0,
               max_bytes: int | None = None) -> tuple[list[tuple[dict[str, Any] | None, int]], int]:
    """Like :func:`read_stream`, with each line's end offset: ``([(object or None, end), ...],
    new_offset)``; None marks a damaged line. Blank lines are skipped.

    Raises:
        OSError: the file cannot be opened or read.
    """
    out: list[tuple[dict[str, Any] | None, int]] = []
    with open_regular(path) as f:  # never a FIFO (blocks), a device (endless) or a symlink
        f.seek(offset)
        data = f.read() if max_bytes is None else f.read(max(1, max_bytes))
        end = data.rfind(b"\n")
        if end < 0:
            if max_bytes is None or len(data) < max_bytes:
                return out, offset  # a line still being written (or torn by a kill)
            # One line longer than the chunk: read it whole, or skip it if absurdly long. The
            # scan stops at MAX_LINE_BYTES: a 20 GiB sparse file without a newline (anyone who
            # can write a stream can make one) would otherwise be read whole on every poll, on
            # the daemon's main loop. No agent writes such a line, so the rest of the file is
            # skipped with it (one damaged line): reading on would cost as much as the file's
            # apparent size, which costs her nothing. Lines appended later are read.
            pos = offset + len(data)
            while True:
                if pos - offset > MAX_LINE_BYTES:
                    end_of_file = max(pos, os.fstat(f.fileno()).st_size)
                    return [(None, end_of_file)], end_of_file
                more = f.read(1 << 20)
                if not more:
                    return out, offset
                nl = more.find(b"\n")
                if nl >= 0:
                    length = pos + nl - offset
                    if length > MAX_LINE_BYTES:
                        return [(None, pos + nl + 1)], pos + nl + 1
                    f.seek(offset)
                    data = f.read(length + 1)
                    end = len(data) - 1
                    break
                pos += len(more)
    pos = offset
    raws, ends = [], []
    for raw in data[: end + 1].split(b"\n")[:-1]:
        pos += len(raw) + 1
        if raw.strip():
            raws.append(raw)
            ends.append(pos)
    return list(zip(_parse_many(raws), ends)), offset + end + 1


def _parse_many(raws: list[bytes]) -> list[dict[str, Any] | None]:
    """Parse lines as one JSON array when every line looks like one object (about twice as fast
    as line by line); if that fails or the count differs, line by line."""
    if len(raws) > 1 and all(r[:1] == b"{" and r[-1:] == b"}" and len(r) <= MAX_LINE_BYTES for r in raws):
        try:
            arr = json.loads(b"[" + b",".join(raws) + b"]")
        except (ValueError, RecursionError):
            arr = None
        if isinstance(arr, list) and len(arr) == len(raws) and all(type(o) is dict for o in arr):
            return arr
    return [_parse(r) for r in raws]


def read_stream(path: str | os.PathLike[str], offset: int = 0,
                max_bytes: int | None = None) -> tuple[list[dict[str, Any]], int, int]:
    """Read complete lines of a stream from byte ``offset``.

    Args:
        path: the stream file.
        offset: byte offset of the first line to read (just past a newline, or 0).
        max_bytes: read at most about this many bytes (whole lines only; one line longer than
            that is still read whole); None reads to the end.

    Returns:
        ``(objects, new_offset, bad_lines)``: parsed objects of every complete line, the offset
        just past the last complete line read (a torn final line is left for the next read), and
        the number of complete lines that were not valid JSON objects (skipped). A line longer
        than :data:`MAX_LINE_BYTES` counts as one bad line and is skipped.

    Raises:
        OSError: the file cannot be opened or read.
    """
    lines, new_offset = read_lines(path, offset, max_bytes)
    objs = [o for o, _ in lines if o is not None]
    return objs, new_offset, len(lines) - len(objs)


class StreamTail:
    """Follow one stream file across calls, remembering the offset (truncation restarts at 0).

    Attributes:
        offset: byte offset just past the last complete line read.
        bad_lines: lines skipped as damaged so far.
        behind: True when the last :meth:`read` made progress and stopped before the end of the
            file (the caller should read again soon).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.bad_lines = 0
        self.behind = False

    def read(self, max_bytes: int | None = CHUNK_BYTES) -> list[dict[str, Any]]:
        """New complete objects since the last call, from at most about ``max_bytes`` of the
        file ([] when the file is missing).

        Raises:
            OSError: the file exists but cannot be read.
        """
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            self.behind = False
            return []
        if size < self.offset:
            self.offset = 0
        before = self.offset
        objs, self.offset, bad = read_stream(self.path, self.offset, max_bytes)
        self.bad_lines += bad
        self.behind = self.offset != before and self.offset < size
        return objs

