"""The agent's incident policy: when to capture. A step that is non-finite by the rule the
daemon's ``nonfinite`` signature also applies (:mod:`sentineld.contracts.nonfinite`) opens an
incident, unless one is open (latched); the capture is written ``post_steps`` steps later, so the
replay can follow a fault that shows one step after it is made; ``rearm_steps`` finite steps in a
row re-arm it (one capture per incident, not one per step): the rule of
:func:`sentineld.contracts.nonfinite.current_incident`, so the daemon alerts the same steps. The
message names what is non-finite in the rule's words. Pure state, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sentineld.contracts.nonfinite import is_nonfinite, nonfinite_reasons
from sentineld.contracts.records import StepRecord
from sentineld.contracts.triggers import NONFINITE

__all__ = ["Incident", "IncidentPolicy"]


@dataclass
class Incident:
    """An open incident: its trigger, first step, gradients at that step (when read in time)."""

    trigger: str
    step: int
    message: str
    grads: Any = None


class IncidentPolicy:
    """Decides, record by record, when a capture is due.

    Args:
        rearm_steps: finite steps after an incident before another may open (AgentConfig).
        post_steps: steps recorded after the incident's step before its capture (AgentConfig).
    """

    def __init__(self, rearm_steps: int, post_steps: int) -> None:
        self.rearm_steps, self.post_steps = rearm_steps, post_steps
        self.latched = False
        self.open: Incident | None = None
        self._finite_streak = 0

    def observe(self, record: StepRecord) -> tuple[bool, Incident | None]:
        """Take one step's record; returns ``(non-finite?, the incident it opened or None)``."""
        bad = is_nonfinite(record)
        if not bad:
            self._finite_streak += 1
            if self.latched and self._finite_streak >= self.rearm_steps:
                self.latched = False
            return False, None
        self._finite_streak = 0
        if self.latched:
            return True, None
        self.latched = True
        what = ", ".join(nonfinite_reasons(record)) or "value"
        self.open = Incident(NONFINITE, record.step, f"non-finite {what} at step {record.step}")
        return True, self.open

    def due(self, last_step: int) -> bool:
        """True when the open incident's capture should be written now (``last_step`` recorded)."""
        return self.open is not None and last_step >= self.open.step + self.post_steps

    def take(self) -> Incident | None:
        """The open incident, closing it (its capture is being written)."""
        inc, self.open = self.open, None
        return inc
