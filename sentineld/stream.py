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
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterator

__all__ = ["StreamWriter", "read_stream", "StreamTail"]

log = logging.getLogger("sentineld.stream")

#: Lines kept in memory while the disk refuses writes; older ones are dropped (and counted).
MAX_PENDING_LINES = 100_000


class StreamWriter:
    """Append JSON lines to ``path`` from a background thread.

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
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._warned = False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._thread = threading.Thread(target=self._run, name="sentineld-stream", daemon=True)
        self._thread.start()

    def put(self, obj: dict[str, Any], urgent: bool = False) -> None:
        """Queue one object; ``urgent`` wakes the writer now (incidents should reach the daemon fast)."""
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            self._pending.append(line)
            if len(self._pending) > MAX_PENDING_LINES:
                self._pending.popleft()
                self.dropped_lines += 1
        if urgent:
            self._wake.set()

    def flush(self) -> None:
        """Write everything queued now, on the calling thread."""
        with self._lock:
            lines = list(self._pending)
            self._pending.clear()
        if not lines:
            return
        data = "".join(lines).encode()
        try:
            # One write per batch of whole lines: a reader never sees half of an earlier line.
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
        except OSError as exc:
            self._requeue(data.decode(errors="replace"))
            if not self._warned:
                self._warned = True
                log.warning("sentineld: cannot write metrics stream %s (%s); keeping up to %d "
                            "lines in memory and retrying", self.path, exc, MAX_PENDING_LINES)

    def _requeue(self, text: str) -> None:
        lines = text.splitlines(keepends=True)
        with self._lock:
            self._pending.extendleft(reversed(lines))
            while len(self._pending) > MAX_PENDING_LINES:
                self._pending.popleft()
                self.dropped_lines += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        """Flush what is queued, stop the thread and close the file."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self.flush()
        try:
            os.close(self._fd)
        except OSError:
            pass


def read_stream(path: str | os.PathLike[str], offset: int = 0) -> tuple[list[dict[str, Any]], int, int]:
    """Read complete lines of a stream from byte ``offset``.

    Returns:
        ``(objects, new_offset, bad_lines)``: parsed objects of every complete line, the offset
        just past the last complete line (a torn final line is left for the next read), and the
        number of complete lines that were not valid JSON objects (skipped).

    Raises:
        OSError: the file cannot be opened or read.
    """
    out: list[dict[str, Any]] = []
    bad = 0
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n")
    if end < 0:
        return out, offset, 0
    for raw in data[: end + 1].splitlines():
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            bad += 1
    return out, offset + end + 1, bad


class StreamTail:
    """Follow one stream file across calls, remembering the offset (truncation restarts at 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.bad_lines = 0

    def read(self) -> list[dict[str, Any]]:
        """New complete objects since the last call ([] when the file is missing)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            self.offset = 0
        objs, self.offset, bad = read_stream(self.path, self.offset)
        self.bad_lines += bad
        return objs

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.read())
