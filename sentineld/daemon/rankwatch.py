"""The daemon's view of one rank's stream: where it is read to, its window of step records, and
what it said about itself (start, end, agent notices).

One :class:`RankWatch` per rank of a :class:`~sentineld.daemon.runwatch.RunWatch` (watchdog's
``DirectorySnapshot``: one value per directory), so everything known of a rank is in one place
and a rank's state is never spread over dicts that must be kept in step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from sentineld.contracts.nonfinite import is_nonfinite
from sentineld.contracts.records import (
    AGENT_NOTICES,
    END,
    REPLICA_DIVERGENCE,
    START,
    STEP,
    ReplicaDivergence,
    StepRecord,
    record_from_json,
)
from sentineld.contracts.stream import CHUNK_BYTES, StreamTail, read_lines

__all__ = ["RankWatch", "AgentNote", "as_int"]


def as_int(v: Any, default: int = 0) -> int:
    """``int(v)``, or ``default`` for a value another process wrote that is not a number."""
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return default


def _parse_record(obj: dict[str, Any]) -> StepRecord | None:
    """A StepRecord from a stream line, or None when a field has the wrong type."""
    try:
        rec = record_from_json(obj)
    except (ValueError, TypeError, OverflowError, AttributeError):
        return None
    for name in ("grad_norm", "lr", "loss_scale"):
        v = getattr(rec, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return None
    if not isinstance(rec.step_s, (int, float)) or not isinstance(rec.time_s, (int, float)):
        return None
    return rec


class AgentNote(NamedTuple):
    """An ``agent_error`` / ``agent_warning`` line. ``fresh`` is False for one a restarted daemon
    re-reads (kept in status, not paged again)."""

    kind: str
    step: int
    message: str
    fresh: bool


@dataclass
class RankWatch:
    """One rank's stream as the daemon has read it.

    Attributes:
        tail: the stream file and the offset read to.
        records: the last ``window`` step records (what the signatures see).
        last_step: the step of the last step record, None before the first.
        ended: the reason of the rank's ``end`` record, None while it runs.
        pid, host: of the rank's process (its ``start`` record; 0 / "" before it).
    """

    tail: StreamTail
    window: int
    records: deque[StepRecord] = field(init=False)
    last_step: int | None = None
    ended: str | None = None
    pid: int = 0
    host: str = ""
    # where each record in ``records`` starts (a restart refills the window from the first)
    _starts: deque[int] = field(init=False)
    # lines read from the file and not handed out yet: (object or None for a damaged line, end offset)
    _buf: deque[tuple[dict[str, Any] | None, int]] = field(default_factory=deque)
    #: step records handed out as new since the signatures last judged this rank (issue 21:
    #: :meth:`sentineld.daemon.alerting.Alerting.evaluate` passes it on and resets it)
    unjudged: int = 0
    _consumed: int = 0  # just past the last line handed out
    _quiet_until: int = -1  # lines ending at or before this were evaluated by the last daemon
    _last_bad: bool = False
    # a replica_divergence line read before any step record: carried by the next one
    _pending_replicas: ReplicaDivergence | None = None
    #: a fresh replica_divergence line was read since :meth:`take_replicas_news`
    _replicas_news: bool = False
    # (size, mtime_ns) of the stream when a read found nothing new: not read again until it changes
    _idle_at: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.records = deque(maxlen=self.window)
        self._starts = deque(maxlen=self.window)

    @classmethod
    def at(cls, path: Path, window: int, offset: int = 0, quiet_until: int = -1) -> RankWatch:
        """A rank read from ``offset`` of its stream ``path``; lines ending at or before
        ``quiet_until`` refill the window without being handed out as new."""
        tail = StreamTail(path)
        tail.offset = offset
        return cls(tail, window, _consumed=offset, _quiet_until=quiet_until)

    @property
    def behind(self) -> bool:
        """Lines are waiting in memory or in the file (read again)."""
        return bool(self._buf) or self.tail.behind

    def read(self, max_records: int | None) -> tuple[list[StepRecord], list[AgentNote]]:
        """Hand out what is new: at most ``max_records`` step records (None: all read), and the
        agent's notices among the lines handed out. A slice ends after a non-finite record that
        follows a finite one (an incident starts there: it is evaluated before more is read).

        Raises:
            OSError: the stream exists but cannot be read (nothing was consumed).
        """
        if not self._buf:
            self._buf.extend(self._read_file())
        new: list[StepRecord] = []
        notes: list[AgentNote] = []
        while self._buf and (max_records is None or len(new) < max_records):
            obj, end = self._buf.popleft()
            start, self._consumed = self._consumed, end
            fresh = end > self._quiet_until
            if obj is None:
                self.tail.bad_lines += 1
                continue
            kind = obj.get("kind")
            if kind == STEP:
                rec = _parse_record(obj)
                if rec is None:
                    self.tail.bad_lines += 1
                    continue
                if self._pending_replicas is not None:
                    rec, self._pending_replicas = replace(rec, replicas=self._pending_replicas), None
                self.records.append(rec)
                self._starts.append(start)
                self.last_step = rec.step
                if fresh:
                    new.append(rec)
                    self.unjudged += 1
                    bad, was_bad = is_nonfinite(rec), self._last_bad
                    self._last_bad = bad
                    if bad and not was_bad and max_records is not None:
                        break
            elif kind == START:
                self.pid = as_int(obj.get("pid"))
                self.host = str(obj.get("host", ""))[:255]
                self.ended = None
            elif kind == END:
                self.ended = str(obj.get("reason", "finished"))[:100]
            elif kind == REPLICA_DIVERGENCE:
                self._replicas(obj, fresh)
            elif kind in AGENT_NOTICES:
                notes.append(AgentNote(str(kind), as_int(obj.get("step"), -1), str(obj.get("message", ""))[:2000],
                                       fresh))
        return new, notes

    def _replicas(self, obj: dict[str, Any], fresh: bool) -> None:
        """Carry a ``replica_divergence`` line on the newest record of the window, where the pure
        signature (``signatures/replicas.py``) sees it; the step it names may have left the
        window already (the comparison lags the step), the verdict keeps that step."""
        try:
            div = ReplicaDivergence.from_json(obj)
        except ValueError:
            self.tail.bad_lines += 1
            return
        if self.records:
            self.records[-1] = replace(self.records[-1], replicas=div)
        else:
            self._pending_replicas = div
        self._replicas_news |= fresh

    def take_replicas_news(self) -> bool:
        """True once after a fresh ``replica_divergence`` line was read (the run is evaluated
        then, even when the line came with no new step record)."""
        news, self._replicas_news = self._replicas_news, False
        return news

    def _read_file(self) -> list[tuple[dict[str, Any] | None, int]]:
        tail = self.tail
        try:
            st = tail.path.stat()
        except FileNotFoundError:
            tail.behind = False
            return []
        size = st.st_size
        if (size, st.st_mtime_ns) == self._idle_at:
            # Unchanged since a read that found no complete line: reading it again on every
            # scan would cost up to MAX_LINE_BYTES per rank and second (a run can hold many
            # streams ending in a partial line), all of it on the daemon's main loop.
            tail.behind = False
            return []
        if size < tail.offset:  # truncated or replaced: start over
            tail.offset = self._consumed = 0
            self._quiet_until = -1
        lines, offset = read_lines(tail.path, tail.offset, CHUNK_BYTES)
        tail.behind = offset != tail.offset and offset < size
        self._idle_at = (size, st.st_mtime_ns) if offset == tail.offset and not lines else None
        tail.offset = offset
        return lines

    def offsets(self) -> tuple[int, int]:
        """``(just past the last line handed out, where the window's first record starts)``: what
        a restarted daemon resumes from (it refills the window from the second, quietly)."""
        return self._consumed, (self._starts[0] if self._starts else self._consumed)
