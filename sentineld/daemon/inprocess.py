"""How the daemon uses the verdicts a training process wrote itself (:mod:`sentineld.contracts.verdict_file`).

For the captures of a run that localizes in process (``run.json``'s ``extra.localize``) the daemon
waits for the verdict file instead of spawning a replay of its own, and falls back to its own
replay (when the run named a recipe) if the file says the localization failed, or the training
process ended without writing it, or it did not come within ``timeout_s``.

Light on purpose: the daemon imports it without torch.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from sentineld.contracts.rundir import RunMeta, parse_capture_name
from sentineld.contracts.verdict import verdict_outcome
from sentineld.contracts.verdict_file import LOCALIZED_TRIGGERS

from .replay_runner import ReplayOutcome
from .verdict_accept import IgnoredVerdicts, read_verdict_file

__all__ = ["InProcessVerdicts"]


def _alive(meta: RunMeta) -> bool:
    if meta.host != socket.gethostname():
        return True  # cannot tell from here: wait for the timeout
    try:
        os.kill(meta.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class InProcessVerdicts:
    """The daemon's decisions for captures of runs that localize in process.

    Args:
        timeout_s: most seconds to wait for a verdict file after the capture was first seen.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, timeout_s: float, clock: Any = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.first_seen: dict[str, float] = {}
        self.ignored = IgnoredVerdicts()  # verdict files not from their run (verdict_accept)

    def decide(self, meta: RunMeta, capture: Path) -> tuple[str, ReplayOutcome | None]:
        """``("deliver", outcome)``, ``("wait", None)`` or ``("spawn", None)`` (the daemon's own replay)."""
        mode = meta.extra.get("localize") if isinstance(meta.extra, dict) else None
        parsed = parse_capture_name(capture.name)
        if mode in (None, "off") or parsed is None or parsed[2] not in LOCALIZED_TRIGGERS:
            return "spawn", None
        key = f"{meta.run_id}@{meta.started_s!r}|{capture}"  # a new run reusing the path waits anew
        t0 = self.first_seen.setdefault(key, self.clock())
        payload, ignored = read_verdict_file(meta, capture)
        if ignored is not None:  # never delivered: counted, and the daemon's own replay decides
            self.ignored.note(capture, ignored)
            return self._fallback(meta, key, f"its verdict file was ignored ({ignored[:1500]})")
        if payload is None:
            if _alive(meta) and self.clock() - t0 < self.timeout_s:
                return "wait", None
            reason = ("the training process ended without writing its verdict" if not _alive(meta)
                      else f"the training process wrote no verdict within {self.timeout_s:g} s")
            return self._fallback(meta, key, reason)
        if isinstance(payload.get("phase"), str) and "schema_version" in payload:
            self.first_seen.pop(key, None)
            elapsed = float(payload.get("elapsed_s") or 0.0)
            return "deliver", ReplayOutcome(verdict_outcome(payload), payload, "", elapsed, 0)
        return self._fallback(meta, key, f"the training process's localization failed: "
                                         f"{str(payload.get('reason', payload))[:1500]}")

    def _fallback(self, meta: RunMeta, key: str, reason: str) -> tuple[str, ReplayOutcome | None]:
        self.first_seen.pop(key, None)
        # A loss_fn run's recorded live objects replay like a recipe (sentineld.replay.live_recipe).
        if meta.recipe or (isinstance(meta.extra, dict) and isinstance(meta.extra.get("live_recipe"), dict)):
            return "spawn", None
        return "deliver", ReplayOutcome("failed", None, reason + "; the run named no recipe, so the "
                                        "daemon cannot replay it (pass recipe= to attach)", 0.0, None)
