"""Everything the daemon holds about one run directory, in one value.

A :class:`RunState` is what :class:`~sentineld.daemon.service.Daemon` keeps per run path: the
run's :class:`~sentineld.daemon.runwatch.RunWatch` (its ranks, windows, active signatures), the
alerts held for the other ranks, when it was last evaluated and saved, and the last failure
logged for it. Forgetting a run (a new run took its path) is one ``del``: nothing of it is left
in another table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sentineld.daemon.outbox import notification_id
from sentineld.daemon.runwatch import RunWatch, load_progress, same_run, save_progress

__all__ = ["RunState", "ProgressStore"]

log = logging.getLogger("sentineld.daemon")


@dataclass
class RunState:
    """One watched run.

    Attributes:
        watch: what was read of the run (streams, run.json, active signatures).
        held: signature key -> wall-clock second its held alert is sent (multi-rank grace).
        last_eval_s: wall-clock second of its last signature evaluation (0: never).
        saved_s: monotonic second its progress was last saved (0: never).
        unsaved: something was read since that save.
        rings_checked_s: monotonic second its on-disk rings were last offered for recovery.
        failure: the last error logged for it (logged again only when it changes).
        sig_config: ``(run.json read, SignatureConfig)``: the config this run is judged with,
            merged once per read of its run.json (``Alerting``), not per evaluation.
    """

    watch: RunWatch
    held: dict[str, float] = field(default_factory=dict)
    last_eval_s: float = 0.0
    saved_s: float = 0.0
    unsaved: bool = False
    rings_checked_s: float = 0.0
    failure: str | None = None
    sig_config: tuple[Any, Any] | None = None

    @property
    def run_dir(self) -> Path:
        return self.watch.run_dir


class ProgressStore:
    """The runs' saved reading progress: one file per run path in ``directory`` (the state dir's
    ``progress/``), so a restarted daemon neither repeats nor misses anything."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, run_dir: Path) -> Path:
        return self.directory / f"{notification_id(str(run_dir))}.json"

    def load(self, run_dir: Path) -> dict[str, Any] | None:
        """The progress saved for the run now in ``run_dir``; None when there is none, it is
        unreadable, or it is of the run that had the path before."""
        saved = load_progress(self.path(run_dir))
        if saved and not same_run(run_dir, saved):
            log.info("run dir %s holds a new run since the last daemon; watching it from the start", run_dir)
            return None
        return saved

    def save(self, state: RunState, now_s: float) -> None:
        """Save the run's progress (``now_s``: monotonic seconds, kept as ``state.saved_s``).

        Raises:
            OSError: the state dir refused it (the run stays ``unsaved``).
        """
        save_progress(self.path(state.run_dir), state.watch)
        state.unsaved, state.saved_s = False, now_s

    def drop(self, run_dir: Path) -> None:
        self.path(run_dir).unlink(missing_ok=True)
