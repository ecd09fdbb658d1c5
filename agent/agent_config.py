"""Agent settings: one frozen dataclass with the defaults and where each comes from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from sentineld.contracts.nonfinite import REARM_STEPS

__all__ = ["AgentConfig"]


@dataclass(frozen=True)
class AgentConfig:
    """How the agent records, keeps and exports.

    Attributes:
        snapshot_every: steps between model+optimizer snapshots, or 0 for "auto": chosen after
            the first snapshot so that snapshots cost ``snapshot_budget`` of step time
            (clamped to [``min_snapshot_every``, ``window // 2``]).
        snapshot_budget: share of step time snapshots may cost in auto mode (0.01 = 1%; the
            issue's overhead target is 2% in all).
        min_snapshot_every: lower bound for auto mode, steps.
        window: most steps of batches kept in host memory (W); two snapshots are kept so a
            clean one before the offending step is always present.
        ring_bytes: most bytes of batches kept; older steps are dropped first.
        metrics_port: Prometheus port (rank r uses ``metrics_port + local rank``); 0 = off;
            -1 = any free port (tests). 9500 is this project's default range (deploy/README.md).
        metrics_port_range: a busy port moves to the next of ``metrics_port + local rank .. +
            metrics_port_range - 1`` before any free port (so a second training process on the
            host stays inside a fixed scrape config's range, e.g. 9500-9515); the port bound is
            in run.json ``extra.metrics_port`` and ``sentineld runs``.
        metrics_addr: bind address; loopback unless you mean to expose it.
        flush_s: seconds between stream writes (the most SIGKILL can lose).
        layer_every: steps between per-layer samples (activations, per-layer norms, update
            ratios) once the run is past its first steps, which are sampled densely (every step,
            then gaps doubling up to this: ``sentineld.agent.sampling.sampled_at``); 0 = off.
            Measured cost in bench/probes_cost.py and bench/activation_probe_cost.py.
        rearm_steps: finite steps after an incident before another capture may be written
            (one capture per incident, not one per step). Default
            :data:`sentineld.contracts.nonfinite.REARM_STEPS`, the daemon's rule for when an
            incident is over (recovery notice) and the next one is alerted: change it and
            captures and alerts may name different incidents.
        post_steps: steps recorded after the offending one before its capture is written, so
            the replay can follow a fault that shows one step later (e.g. a grad norm that
            overflows before the parameters do); the capture is also written at close.
        spike_captures: most ``spike`` captures per run: a finite loss spike by the
            ``loss_spike`` rule (:mod:`sentineld.signatures.spike`, its per-step cost a few us)
            writes a capture of the ring that ``sentineld replay`` explains (data, state or
            interaction); 0 = off. Default 4 (each capture is the ring: bounded by ring_bytes).
        capture_on_crash: write a ``crash`` capture when the watched block raises, when an
            exception reaches ``sys.excepthook`` (loops without ``with``), and on SIGTERM.
        capture_on_sigterm: install a SIGTERM handler (main thread only; not when SIGTERM is
            ignored) that writes the ``crash`` capture, closes the agent, then does what the
            previous handler did: calls it, or dies by SIGTERM as before (preemption, ``kill``,
            ``torchrun`` shutting workers down). The capture must fit in the grace period the
            scheduler gives before SIGKILL (Kubernetes: 30 s); ``disk_ring`` covers the rest.
        disk_ring: also persist the ring buffer under the run directory as it is taken
            (``ring-rank<R>-<pid>/``, bounded like the RAM ring), so a run killed without
            warning (SIGKILL, OOM killer) still yields a ``crash`` capture, assembled by the
            daemon or ``sentineld recover``. Writes happen on a background thread; the per-step
            cost is measured by ``bench/disk_ring_cost.py``.
        replica_every: steps between DDP replica checks (each rank checksums its parameters
            after the optimizer step and the ranks compare through the job's store:
            ``sentineld.agent.replicas``); 0 = off. 25 names a silently changed replica within
            50 steps at one checksum pass over the parameters per 25 steps (docs/distributed.md).
    """

    snapshot_every: int = 0
    snapshot_budget: float = 0.01
    min_snapshot_every: int = 10
    window: int = 256
    ring_bytes: int = 1 << 30
    metrics_port: int = 9500
    metrics_addr: str = "127.0.0.1"
    metrics_port_range: int = 16
    flush_s: float = 1.0
    layer_every: int = 50
    rearm_steps: int = REARM_STEPS
    post_steps: int = 2
    spike_captures: int = 4
    capture_on_crash: bool = True
    capture_on_sigterm: bool = True
    disk_ring: bool = False
    replica_every: int = 25

    def __post_init__(self) -> None:
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = auto), got {self.snapshot_every}")
        if not 0 < self.snapshot_budget < 1:
            raise ValueError(f"snapshot_budget must be in (0, 1), got {self.snapshot_budget}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 steps, got {self.window}")
        if self.snapshot_every > self.window:
            raise ValueError(f"snapshot_every ({self.snapshot_every}) must be <= window "
                             f"({self.window}) or no clean snapshot would precede an incident")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ValueError(f"metrics_port must be -1, 0 or a TCP port, got {self.metrics_port}")
        if self.metrics_port_range < 1:
            raise ValueError(f"metrics_port_range must be >= 1 ports, got {self.metrics_port_range}")
        if not self.flush_s > 0:
            raise ValueError(f"flush_s must be > 0 seconds, got {self.flush_s}")
        if self.replica_every < 0:
            raise ValueError(f"replica_every must be >= 0 (0 = off), got {self.replica_every}")
        if self.spike_captures < 0:
            raise ValueError(f"spike_captures must be >= 0 (0 = off), got {self.spike_captures}")
        if self.layer_every < 0 or self.rearm_steps < 0 or self.post_steps < 0 or self.ring_bytes <= 0:
            raise ValueError("layer_every, rearm_steps and post_steps must be >= 0 and ring_bytes > 0")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "AgentConfig":
        """Build from a dict; an unknown key raises ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown agent setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)
