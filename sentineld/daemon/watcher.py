"""Which run directories changed: file events (watchdog) and explicit marks, collected for the
main loop. The set is shared by the observer's thread, the recovery thread and the main loop.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["DirtyRuns", "start_observer"]

log = logging.getLogger("sentineld.daemon")


class DirtyRuns:
    """The run directories to look at next, and the event that wakes the main loop.

    Args:
        runs_dir: parent of the run directories; paths elsewhere are ignored.
    """

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = runs_dir
        self.wake = threading.Event()
        self._dirty: set[Path] = set()
        self._lock = threading.Lock()

    def mark_path(self, path: Path) -> None:
        """A file event at ``path``: mark its run directory (temp files are ignored)."""
        if path.name.endswith(".tmp"):
            return
        try:
            rel = path.relative_to(self.runs_dir)
        except ValueError:
            return
        if rel.parts:
            self.add(self.runs_dir / rel.parts[0])

    def add(self, run_dir: Path) -> None:
        """Look at ``run_dir`` on the main loop's next turn."""
        with self._lock:
            self._dirty.add(run_dir)
        self.wake.set()

    def scan(self) -> set[Path]:
        """Every run directory in the runs dir now (none when it cannot be listed: logged)."""
        try:
            # A symlink is no run dir (the agent makes real ones): in a shared runs dir it would let
            # another user point the daemon at any folder (a private run of ours) under a name she picks.
            return {p for p in self.runs_dir.iterdir() if p.is_dir() and not p.is_symlink()}
        except OSError as exc:
            log.warning("cannot list runs dir %s: %s", self.runs_dir, exc)
            return set()

    def take(self) -> set[Path]:
        """The marked run directories; the set starts empty again."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        return dirty


def start_observer(dirty: DirtyRuns, polling: bool, poll_s: float) -> Any:
    """Start a watchdog observer feeding ``dirty`` (stop and join it at exit).

    Args:
        polling: use watchdog's PollingObserver (network filesystems without inotify).
        poll_s: the polling observer's interval, seconds.
    """
    from watchdog.events import FileSystemEventHandler  # noqa: PLC0415
    from watchdog.observers import Observer  # noqa: PLC0415
    from watchdog.observers.polling import PollingObserver  # noqa: PLC0415

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: Any) -> None:
            # Reads are not changes: the daemon's own reads of run.json and the streams raise
            # "opened" / "closed_no_write" events, and reacting to them reads again, for ever.
            if getattr(event, "event_type", "") in ("opened", "closed_no_write"):
                return
            for p in (getattr(event, "src_path", None), getattr(event, "dest_path", None)):
                if p:
                    dirty.mark_path(Path(os.fsdecode(p)))

    obs = PollingObserver(timeout=poll_s) if polling else Observer()
    obs.schedule(Handler(), str(dirty.runs_dir), recursive=True)
    obs.start()
    return obs
