"""When the agent snapshots: every ``snapshot_every`` steps, chosen in auto mode so snapshots
cost ``snapshot_budget`` of step time, and bounded so the ring always holds a whole span
(snapshot .. offending step + ``post_steps``). No snapshot is taken while an incident is open:
the one before it must stay in the ring.

A first snapshot is taken at attach, before step 0 (``initial``): without it a fault in the
steps before the first snapshot (an optimizer step that breaks the parameters at step 0, in a
loop whose model forward the agent never sees) had no clean snapshot, so no capture and no
replay (issue 10). It costs one snapshot copy at attach and no memory beyond the ring's two
snapshots: it is one of them, and the first step's own snapshot (same step) replaces it.
"""

from __future__ import annotations

import math
from collections import deque

from .agent_config import AgentConfig

__all__ = ["SnapshotSchedule"]


class SnapshotSchedule:
    """The snapshot cadence and whether one is due.

    Attributes:
        every: current cadence in steps.
        due: a snapshot should be taken at the next step start.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.every = config.snapshot_every or config.min_snapshot_every
        self.due = True
        self._auto = config.snapshot_every == 0
        self._since = 0
        self._cost_s = 0.0
        self._step_times: deque[float] = deque(maxlen=20)

    def taken(self, cost_s: float, initial: bool = False) -> None:
        """A snapshot was taken; it cost ``cost_s`` seconds of the training thread.

        ``initial``: the one at attach; the first step still takes its own (the state may
        change between attach and step 0, e.g. a checkpoint loaded after attach).
        """
        self._cost_s = max(self._cost_s * 0.5, cost_s)
        if initial:
            return
        self.due = False
        self._since = 0

    def step_time(self, step_s: float) -> None:
        """A step took ``step_s`` seconds (the median of the last 20 sets the auto cadence)."""
        self._step_times.append(step_s)

    def step_done(self, latched: bool) -> None:
        """A step was recorded (after :meth:`tune`); ``latched``: an incident is open."""
        self._since += 1
        if not latched and self._since >= self.every:
            self.due = True

    def tune(self, last_step_nbytes: int, disk_cost_s: float = 0.0) -> None:
        """Re-derive the cadence (cheap; the agent calls it every 16 steps).

        Args:
            last_step_nbytes: host bytes of the newest ring entry (0 when none).
            disk_cost_s: CPU seconds the on-disk ring's writer spent on the newest snapshot
                file (0.0 without a disk ring): in auto mode a snapshot costs its copy plus its
                write, and the two together are kept within ``snapshot_budget`` of step time
                (issue 23: counting the copy alone, the disk ring's snapshot files cost a 5-ms
                MLP step 35-435 us, 4x its step records). On a machine with a free core the
                write runs beside the training, so this is the conservative side.
        """
        cfg, k = self.config, self.every
        if self._auto and len(self._step_times) >= 5:
            step_s = sorted(self._step_times)[len(self._step_times) // 2]
            if step_s > 0:
                k = math.ceil((self._cost_s + disk_cost_s) / (cfg.snapshot_budget * step_s))
                k = max(cfg.min_snapshot_every, min(k, cfg.window // 2))
        if last_step_nbytes > 0:
            fits = cfg.ring_bytes // last_step_nbytes
            k = max(1, min(k, (fits - cfg.post_steps) // 2))
        self.every = k
