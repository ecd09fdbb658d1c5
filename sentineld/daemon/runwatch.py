"""The daemon's view of one run directory: streams tailed, windows of records, captures seen.

:meth:`RunWatch.poll` does the I/O (read new stream lines, list captures); what to alert on is
decided by :mod:`sentineld.daemon.policy` over its state. Progress
(stream offsets, active signatures, captures seen) is saved to the daemon's state dir so a
restarted daemon neither repeats nor misses anything.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.nonfinite import recovered_at
from sentineld.contracts.records import StepRecord
from sentineld.contracts.rundir import RunDir, RunDirError, RunMeta, list_captures, read_run_meta
from sentineld.contracts.safeio import SafeDir
from sentineld.daemon.rankwatch import AgentNote, RankWatch, as_int
from sentineld.daemon.statedir import read_state_json, write_json_atomic

__all__ = ["RunWatch", "save_progress", "load_progress", "stale_temp_captures", "STALE_TMP_AGE_S",
           "pid_alive", "same_run", "remove_stale_temps"]

log = logging.getLogger("sentineld.daemon")


@dataclass
class RunWatch:
    """State of one watched run: its ranks (one :class:`RankWatch` each), ``run.json``, the
    signatures active, the captures seen. ``error`` holds why its files cannot be read (it is
    retried).

    Streams are read a bounded chunk at a time (:data:`sentineld.contracts.stream.CHUNK_BYTES`) and handed
    out at most ``max_records`` step records per rank per :meth:`poll`, so a daemon catching up
    on a long stream holds a bounded slice of it and evaluates every part of it (a window of
    ``window`` records, evaluated every ``window // 2`` records, sees every record). A slice
    also ends at each non-finite record that follows a finite one, so two incidents read in one
    go (a daemon catching up on a run that recovered and broke again) are alerted both.
    """

    run_dir: Path
    window: int = 200
    meta: RunMeta | None = None
    error: str | None = None
    ranks: dict[int, RankWatch] = field(default_factory=dict)
    active: dict[str, dict[str, Any]] = field(default_factory=dict)
    captures_seen: set[str] = field(default_factory=set)
    agent_errors: list[str] = field(default_factory=list)
    last_alert_s: dict[str, float] = field(default_factory=dict)
    reported_error: str | None = None
    meta_error: str | None = None
    notices: list[tuple[int, str, int, str]] = field(default_factory=list)  # (rank, kind, step, message)
    replaced: bool = False
    crash_paged: bool = False  # a crash capture of this run was paged (one page per run)
    override_problems: list[str] = field(default_factory=list)  # its run.json signature overrides refused
    _meta_key: tuple[int, int, int] | None = None

    @property
    def run_id(self) -> str:
        return self.meta.run_id if self.meta else self.run_dir.name

    @property
    def incident_scope(self) -> str:
        """What notification and replay ids are made of: the run id plus when the run started, so
        a new run reusing the id of a deleted or moved one gets its own notifications."""
        if self.meta is not None and self.meta.started_s:
            return f"{self.run_id}@{self.meta.started_s!r}"
        return self.run_id

    @property
    def all_ended(self) -> bool:
        """Every rank wrote its ``end`` record (the run finished, crashed or was stopped)."""
        return bool(self.ranks) and all(rk.ended is not None for rk in self.ranks.values())

    @property
    def last_step(self) -> int | None:
        """The latest step any rank recorded (None before the first)."""
        return max((rk.last_step for rk in self.ranks.values() if rk.last_step is not None), default=None)

    @property
    def ended(self) -> dict[int, str]:
        """``{rank: end reason}`` of the ranks that ended."""
        return {r: rk.ended for r, rk in self.ranks.items() if rk.ended is not None}

    @property
    def bad_lines(self) -> int:
        """Damaged stream lines skipped so far, all ranks."""
        return sum(rk.tail.bad_lines for rk in self.ranks.values())

    def recovery_step(self, signature: str, since_step: int, last: int) -> int:
        """The step a recovery notice names: for ``nonfinite``, where its incident (begun at
        ``since_step``) was over, which the notice may follow later; else ``last``."""
        if signature != "nonfinite":
            return last
        steps = [s for rk in self.ranks.values() if (s := recovered_at(list(rk.records), since_step)) is not None]
        return min(steps, default=last)

    @property
    def behind(self) -> bool:
        """True when records are waiting to be handed out (call :meth:`poll` again)."""
        return any(rk.behind for rk in self.ranks.values())

    def take_notices(self) -> list[tuple[int, str, int, str]]:
        """The agent notices read since the last call: ``(rank, kind, step, message)``."""
        notices, self.notices = self.notices, []
        return notices

    def poll(self, max_records: int | None = None) -> tuple[dict[int, list[StepRecord]], list[Path]]:
        """Read what is new: ``({rank: new step records}, new capture paths)`` (now in
        ``captures_seen``).

        Args:
            max_records: most step records handed out per rank (None: all read so far).

        Never raises for a damaged run: the reason goes to ``error`` and the daemon keeps
        watching the other runs.
        """
        new: dict[int, list[StepRecord]] = {}
        try:
            names = os.listdir(self.run_dir)
        except OSError as exc:
            self.error = str(exc)
            return new, []
        self.error = None
        self._read_meta()
        if self.replaced:
            return new, []  # another run now: the daemon starts a fresh watch of it
        run_dir = RunDir(self.run_dir)
        for name in names:
            rank = RunDir.stream_rank(name)
            if rank is not None and rank not in self.ranks:
                self.ranks[rank] = RankWatch.at(run_dir.stream(rank), self.window)
        for rank, rk in self.ranks.items():
            try:
                recs, notes = rk.read(max_records)
            except OSError as exc:
                self.error = f"{rk.tail.path}: {exc}"
                continue
            if recs or rk.take_replicas_news():
                new[rank] = recs  # possibly empty: a replica divergence alone is news too
            for note in notes:
                self._agent_note(rank, note)
        caps = []
        try:
            for _rank, _step, _trigger, path in list_captures(self.run_dir):
                if path.name not in self.captures_seen:
                    self.captures_seen.add(path.name)
                    caps.append(path)
        except OSError as exc:
            self.error = str(exc)
        return new, caps

    def _agent_note(self, rank: int, note: AgentNote) -> None:
        self.agent_errors.append(note.message[:500])
        del self.agent_errors[:-20]
        if note.fresh:  # not one a restart re-reads
            self.notices.append((rank, note.kind, note.step, note.message))

    def _read_meta(self) -> None:
        """(Re)read ``run.json`` when it changed. A damaged one is an ``error`` (shown in status),
        not a reason to stop reading the streams: their NaN is still alerted. A ``run.json`` of
        another run (other ``started_s``: the directory was deleted or moved and a run with the
        same id took its place) sets ``replaced``; the daemon then watches it as a new run."""
        path = self.run_dir / RunDir.RUN_JSON
        try:
            st = os.lstat(path)
            key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key == self._meta_key and (self.meta is not None or self.meta_error is not None):
            return  # unchanged since the last read (good or bad): not parsed again
        try:
            meta = read_run_meta(self.run_dir)
        except RunDirError as exc:
            self.meta_error = str(exc)
            self._meta_key = key
            return
        if meta.run_id != self.run_dir.name:
            # The agent names its run dir by the run id (or id.2, ...; it writes that into run.json),
            # and a run dir is the only place the daemon knows a run by. A run.json naming another
            # id would let whoever owns this dir speak for that run: her verdict naming "exp1" would
            # pass the "names this run" check and go out as "replay of run exp1". Its stream is still
            # alerted, as this dir's run; nothing is replayed or taken from it as a verdict.
            self.meta_error = (f"{path}: run.json names run {meta.run_id[:80]!r}, but this run dir is "
                               f"{self.run_dir.name!r}; a run is known by its directory's name (renamed? "
                               "replay it by hand: sentineld replay <dir>)")
            self._meta_key, self.meta = key, None
            return
        self._meta_key, self.meta_error = key, None
        if self.meta is not None and meta.started_s != self.meta.started_s:
            self.replaced = True
        self.meta = meta

    def log_error_change(self, grace_s: float) -> None:
        """Log ``error`` when it changed (once), and when it cleared. A run directory younger than
        ``grace_s`` seconds without its run.json is not reported: the agent is writing it."""
        if self.error and not self._young(grace_s):
            if self.error != self.reported_error:
                log.warning("run %s: %s (still watching the other runs)", self.run_dir.name, self.error)
                self.reported_error = self.error
        elif not self.error and self.reported_error:
            log.info("run %s: readable again", self.run_dir.name)
            self.reported_error = None

    def _young(self, grace_s: float) -> bool:
        if self.meta is not None:
            return False
        try:
            return time.time() - self.run_dir.stat().st_mtime < grace_s
        except OSError:
            return False

    def ring_dirs(self) -> list[Path]:
        """On-disk ring buffers (``ring-rank<R>-<pid>/``) in this run directory."""
        return RunDir(self.run_dir).ring_dirs()

    def status(self) -> dict[str, Any]:
        """This run's entry in the daemon's ``status.json``."""
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "ranks": sorted(self.ranks),
                "last_step": self.last_step,
                "ended": {str(k): v for k, v in self.ended.items()},
                "active": sorted(self.active), "captures": len(self.captures_seen),
                "error": self.error or self.meta_error, "bad_lines": self.bad_lines,
                "agent_warnings": self.agent_errors[-3:],
                "signature_overrides_refused": self.override_problems}

    # ---------------------------------------------------------- persistence
    def progress(self) -> dict[str, Any]:
        """What to save so a restarted daemon resumes where this one stopped.

        ``offsets`` is just past the last record handed out; ``window_offsets`` is where the
        records still in the window start, so a restart refills the window (without alerting on
        it again) and the signatures see the same history.
        """
        offsets = {str(r): rk.offsets() for r, rk in self.ranks.items()}
        return {"offsets": {r: o[0] for r, o in offsets.items()},
                "window_offsets": {r: o[1] for r, o in offsets.items()},
                "active": self.active, "captures_seen": sorted(self.captures_seen),
                "last_step": {str(r): rk.last_step for r, rk in self.ranks.items() if rk.last_step is not None},
                "ended": {str(r): v for r, v in self.ended.items()},
                "last_alert_s": self.last_alert_s,
                "started_s": self.meta.started_s if self.meta else None}

    def restore(self, saved: dict[str, Any]) -> None:
        """Resume from :meth:`progress` output (offsets past records already evaluated)."""
        win = saved.get("window_offsets", {}) if isinstance(saved.get("window_offsets"), dict) else {}
        run_dir = RunDir(self.run_dir)
        for r, off in saved.get("offsets", {}).items():
            rank, off = as_int(r), as_int(off)
            start = min(as_int(win.get(r, off), off), off)
            # records up to ``off`` were evaluated before: refill only
            self.ranks[rank] = RankWatch.at(run_dir.stream(rank), self.window, start, quiet_until=off)
        self.active = dict(saved.get("active", {}))
        self.captures_seen = set(saved.get("captures_seen", []))
        for r, s in saved.get("last_step", {}).items():
            if as_int(r) in self.ranks:
                self.ranks[as_int(r)].last_step = as_int(s)
        for r, v in saved.get("ended", {}).items():
            if as_int(r) in self.ranks:
                self.ranks[as_int(r)].ended = str(v)
        self.last_alert_s = {str(k): float(v) for k, v in (saved.get("last_alert_s") or {}).items()
                             if isinstance(v, (int, float))}


#: A temp capture untouched this long, of a process that is gone, will never be finished.
STALE_TMP_AGE_S = 60.0


def stale_temp_captures(rw: RunWatch, now_s: float, this_host: str,
                        alive: Callable[[int], bool]) -> list[Path]:
    """``capture-rank<R>-*.h5.tmp`` files of ``rw`` a killed training process left behind.

    A temp file is stale when it is a regular file (never a symlink: deleting through one would
    remove a file elsewhere), older than :data:`STALE_TMP_AGE_S`, and rank R's process ran on
    this host and is no longer alive. Files of other hosts' ranks are left to their daemon.
    """
    out = []
    for rank, rk in rw.ranks.items():
        if not rk.pid or rk.host != this_host or alive(rk.pid):
            continue
        for p in RunDir(rw.run_dir).unfinished_captures(rank):
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and now_s - st.st_mtime >= STALE_TMP_AGE_S:
                out.append(p)
    return out


def save_progress(path: Path, rw: RunWatch) -> None:
    """Write ``rw``'s progress atomically (0600, the safe writer)."""
    write_json_atomic(path, rw.progress())


def load_progress(path: Path) -> dict[str, Any] | None:
    """Saved progress, or None (missing or damaged: start from the beginning; a damaged file is
    moved aside with a warning)."""
    obj = read_state_json(path, "the run is read from its start")
    return obj if isinstance(obj, dict) else None


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def same_run(run_dir: Path, saved: dict[str, Any]) -> bool:
    """False when saved progress belongs to another run than the one now in ``run_dir`` (its
    ``started_s`` differs); True when it matches or cannot be told (older progress, bad run.json)."""
    started = saved.get("started_s")
    if not isinstance(started, (int, float)):
        return True
    try:
        return read_run_meta(run_dir).started_s == started
    except RunDirError:
        return True


def remove_stale_temps(rw: RunWatch) -> int:
    """Delete :func:`stale_temp_captures` of ``rw`` (a SIGKILL during a capture write leaves up to
    hundreds of MB); returns how many were removed."""
    import socket  # noqa: PLC0415

    n = 0
    stale = stale_temp_captures(rw, time.time(), socket.gethostname(), pid_alive)
    if not stale:
        return 0
    try:
        # Through the run dir's descriptor, never following a link: in a shared runs dir its owner
        # can swap her run dir for a link to a folder of ours between the check and the unlink.
        d = SafeDir.open(rw.run_dir)
    except OSError:
        return 0
    with d:
        for p in stale:
            try:
                if not stat.S_ISREG(d.lstat(p.name).st_mode):
                    continue
                os.unlink(p.name, dir_fd=d.fd)
            except OSError:
                continue
            n += 1
            log.info("run %s: removed %s, a capture its killed process never finished", rw.run_id, p.name)
    return n
