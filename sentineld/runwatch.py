"""The daemon's view of one run directory: streams tailed, windows of records, captures seen.

:meth:`RunWatch.poll` does the I/O (read new stream lines, list captures); what to alert on is
decided by pure functions (:func:`merge_verdicts`, :func:`transitions`) over its state. Progress
(stream offsets, active signatures, captures seen) is saved to the daemon's state dir so a
restarted daemon neither repeats nor misses anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .records import StepRecord, record_from_json
from .rundir import RunDirError, RunMeta, list_captures, read_run_meta
from .stream import StreamTail

__all__ = ["RunWatch", "Active", "merge_verdicts", "transitions"]

log = logging.getLogger("sentineld.daemon")
_STREAM = re.compile(r"^stream-rank(\d+)\.jsonl$")


@dataclass
class Active:
    """A firing signature of a run: first step, ranks that showed it, and the verdict's fields."""

    signature: str
    module: str | None
    step: int
    ranks: list[int]
    severity: str
    message: str
    numbers: dict[str, float]
    fix: str
    notified: bool = False

    @property
    def key(self) -> str:
        return f"{self.signature}@{self.module}" if self.module else self.signature


def merge_verdicts(per_rank: dict[int, Sequence[Any]]) -> dict[str, Active]:
    """One :class:`Active` per (signature, module) across ranks: earliest step, all ranks named.

    The ranks of a data-parallel job fail together (gradients are all-reduced), so a run gets one
    alert naming every rank, and the rank with the earliest step first.
    """
    out: dict[str, Active] = {}
    for rank in sorted(per_rank):
        for v in per_rank[rank]:
            a = Active(v.signature, v.module, int(v.step), [rank], v.severity, v.message,
                       dict(v.numbers), v.fix)
            cur = out.get(a.key)
            if cur is None:
                out[a.key] = a
            else:
                if rank not in cur.ranks:
                    cur.ranks.append(rank)
                if a.step < cur.step:
                    a.ranks = cur.ranks
                    out[a.key] = a
    return out


def transitions(before: Iterable[str], now: dict[str, Active]) -> tuple[list[Active], list[str]]:
    """``(newly firing, cleared keys)`` between the previous and the current active sets."""
    prev = set(before)
    return [a for k, a in now.items() if k not in prev], sorted(prev - set(now))


@dataclass
class RunWatch:
    """State of one watched run. ``error`` holds why its files cannot be read (it is retried)."""

    run_dir: Path
    window: int = 200
    meta: RunMeta | None = None
    error: str | None = None
    tails: dict[int, StreamTail] = field(default_factory=dict)
    records: dict[int, deque[StepRecord]] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    active: dict[str, dict[str, Any]] = field(default_factory=dict)
    captures_seen: set[str] = field(default_factory=set)
    agent_errors: list[str] = field(default_factory=list)
    bad_lines: int = 0

    @property
    def run_id(self) -> str:
        return self.meta.run_id if self.meta else self.run_dir.name

    def poll(self) -> tuple[dict[int, list[StepRecord]], list[Path]]:
        """Read what is new: ``({rank: new step records}, new capture paths)``.

        Never raises for a damaged run: the reason goes to ``error`` and the daemon keeps
        watching the other runs.
        """
        new: dict[int, list[StepRecord]] = {}
        try:
            if self.meta is None:
                self.meta = read_run_meta(self.run_dir)
            names = os.listdir(self.run_dir)
        except (RunDirError, OSError) as exc:
            self.error = str(exc)
            return new, []
        self.error = None
        for name in names:
            m = _STREAM.match(name)
            if m and int(m.group(1)) not in self.tails:
                rank = int(m.group(1))
                self.tails[rank] = StreamTail(self.run_dir / name)
                self.records[rank] = deque(maxlen=self.window)
        for rank, tail in self.tails.items():
            try:
                objs = tail.read()
            except OSError as exc:
                self.error = f"{tail.path}: {exc}"
                continue
            self.bad_lines = sum(t.bad_lines for t in self.tails.values())
            for obj in objs:
                kind = obj.get("kind")
                if kind == "step":
                    try:
                        rec = record_from_json(obj)
                    except ValueError:
                        tail.bad_lines += 1
                        continue
                    self.records[rank].append(rec)
                    self.last_step[rank] = rec.step
                    new.setdefault(rank, []).append(rec)
                elif kind == "start":
                    self.pids[rank] = int(obj.get("pid", 0) or 0)
                    self.ended.pop(rank, None)
                elif kind == "end":
                    self.ended[rank] = str(obj.get("reason", "finished"))
                elif kind in ("agent_error", "agent_warning"):
                    self.agent_errors.append(str(obj.get("message", ""))[:500])
                    del self.agent_errors[:-20]
        caps = []
        try:
            for _rank, _step, _trigger, path in list_captures(self.run_dir):
                if path.name not in self.captures_seen:
                    caps.append(path)
        except OSError as exc:
            self.error = str(exc)
        return new, caps

    # ---------------------------------------------------------- persistence
    def progress(self) -> dict[str, Any]:
        """What to save so a restarted daemon resumes where this one stopped."""
        return {"offsets": {str(r): t.offset for r, t in self.tails.items()},
                "active": self.active, "captures_seen": sorted(self.captures_seen),
                "last_step": {str(r): s for r, s in self.last_step.items()},
                "ended": {str(r): v for r, v in self.ended.items()}}

    def restore(self, saved: dict[str, Any]) -> None:
        """Resume from :meth:`progress` output (offsets past records already evaluated)."""
        for r, off in saved.get("offsets", {}).items():
            rank = int(r)
            tail = StreamTail(self.run_dir / f"stream-rank{rank}.jsonl")
            tail.offset = int(off)
            self.tails[rank] = tail
            self.records[rank] = deque(maxlen=self.window)
        self.active = dict(saved.get("active", {}))
        self.captures_seen = set(saved.get("captures_seen", []))
        self.last_step = {int(r): int(s) for r, s in saved.get("last_step", {}).items()}
        self.ended = {int(r): str(v) for r, v in saved.get("ended", {}).items()}


def save_progress(path: Path, rw: RunWatch) -> None:
    """Write ``rw``'s progress atomically (0600)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rw.progress(), f)
    os.replace(tmp, path)


def load_progress(path: Path) -> dict[str, Any] | None:
    """Saved progress, or None (missing or unreadable: start from the beginning)."""
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
