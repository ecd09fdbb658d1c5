"""The agent's incident policy: when to capture. A step that is non-finite by the rule the
daemon's ``nonfinite`` signature also applies (:mod:`sentineld.contracts.nonfinite`) opens an
incident, unless one is open (latched); the capture is written ``post_steps`` steps later, so the
replay can follow a fault that shows one step after it is made; ``rearm_steps`` finite steps in a
row re-arm it (one capture per incident, not one per step): the rule of
:func:`sentineld.contracts.nonfinite.current_incident`, so the daemon alerts the same steps. The
message names what is non-finite in the rule's words. A finite loss spike
(:class:`sentineld.signatures.spike.SpikeTracker`, the daemon's ``loss_spike`` rule) opens a
``spike`` incident the same way when no incident is open, at most ``max_spikes`` per run (each
writes a capture the replay explains). Pure state, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from sentineld.contracts.nonfinite import is_nonfinite, nonfinite_reasons
from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.contracts.treecodec import map_tensors
from sentineld.contracts.triggers import NONFINITE, SPIKE
from sentineld.signatures.spike import SpikeTracker

from .ring import walk_tensors

__all__ = ["Incident", "IncidentPolicy", "batch_check", "params_nonfinite"]


@dataclass
class Incident:
    """An open incident: its trigger, first step and what went non-finite (the capture's message)."""

    trigger: str
    step: int
    message: str


class IncidentPolicy:
    """Decides, record by record, when a capture is due.

    Args:
        rearm_steps: finite steps after an incident before another may open (AgentConfig).
        post_steps: steps recorded after the incident's step before its capture (AgentConfig).
        max_spikes: most ``spike`` captures per run (AgentConfig.spike_captures; 0 = off).
    """

    def __init__(self, rearm_steps: int, post_steps: int, max_spikes: int = 0) -> None:
        self.rearm_steps, self.post_steps = rearm_steps, post_steps
        self.latched = False
        self.open: Incident | None = None
        self._finite_streak = 0
        self.spikes = SpikeTracker() if max_spikes > 0 else None
        self.spikes_left = max_spikes

    def observe(self, record: StepRecord) -> tuple[bool, Incident | None]:
        """Take one step's record; returns ``(non-finite?, the incident it opened or None)``."""
        bad = is_nonfinite(record)
        if not bad:
            self._finite_streak += 1
            if self.latched and self._finite_streak >= self.rearm_steps:
                self.latched = False
            return False, self._spike(record)
        self._finite_streak = 0
        if self.latched:
            return True, None
        self.latched = True
        what = ", ".join(nonfinite_reasons(record)) or "value"
        self.open = Incident(NONFINITE, record.step, f"non-finite {what} at step {record.step}")
        return True, self.open

    def _spike(self, record: StepRecord) -> Incident | None:
        """A ``spike`` incident when ``record`` opens a loss spike and nothing else is open."""
        if self.spikes is None:
            return None
        v = self.spikes.observe(record.step, record.loss, record.grad_norm)
        if v is None or self.open is not None or self.latched or self.spikes_left <= 0:
            return None
        self.spikes_left -= 1
        self.open = Incident(SPIKE, record.step, v.message)
        return self.open

    def due(self, last_step: int) -> bool:
        """True when the open incident's capture should be written now (``last_step`` recorded)."""
        return self.open is not None and last_step >= self.open.step + self.post_steps

    def take(self) -> Incident | None:
        """The open incident, closing it (its capture is being written)."""
        inc, self.open = self.open, None
        return inc


def batch_check(batch: Any) -> torch.Tensor | None:
    """The sum of the floating tensors of ``batch`` (any tree, micro-batch lists included) as a
    0-d float32 tensor on their device: nan or inf when an element is (nan + x = nan,
    inf + finite = inf, inf - inf = nan).

    A sum, not max |x|: on CPU ``sum`` is vectorised (about 50 us for a 64x3x32x32 float32
    batch, a third of the ring's copy of it), while ``abs().amax()``, ``isfinite().all()`` and
    ``_foreach_norm(inf)`` cost 1.3-17x that copy (our measurement, one CPU thread).
    Accumulated in float32, so a float16 batch's sum does not overflow at 65504; it can only
    overflow for elements near 1e33, which overflow the first layer anyway. No host sync: the
    value travels to the host with the step's other values (:mod:`.readback`), and
    ``StepRecord.input_nonfinite`` is read from it. None when the batch holds no non-empty
    floating tensor (token ids, images as uint8).
    """
    sums: list[torch.Tensor] = []

    def add(t: torch.Tensor) -> torch.Tensor:
        # Dense tensors only: a nested or sparse batch is copied to the ring as before, unchecked.
        if t.is_floating_point() and t.layout == torch.strided and not t.is_nested and t.numel() > 0:
            sums.append(t.detach().sum(dtype=torch.float32))
        return t

    walk_tensors(batch, add)  # (map_tensors' result, by exact type first: agent/ring.py)
    if not sums:
        return None
    if len(sums) == 1:
        return sums[0]
    dev = sums[0].device
    return torch.stack([x.to(dev, non_blocking=True) for x in sums]).sum()


def batch_nonfinite(host_batch: Any) -> bool | None:
    """True when a floating tensor of ``host_batch`` (the ring's host copy of a step's batch)
    holds a nan or inf element: the exact test behind a non-finite :func:`batch_check` sum.

    The sum also turns inf when finite elements overflow float32 together: an additive
    attention mask filled with ``torch.finfo(torch.float32).min`` (as Hugging Face builds
    them), or float64 features above 3.4e38. Only a step whose sum is non-finite is re-checked
    (at readback, on host, no device sync), so the usual step pays nothing for it. None when
    the copy holds no floating tensor to look at (the ring kept none): the sum then decides.
    """
    found: bool | None = None

    def look(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        if (not found and t.is_floating_point() and t.layout == torch.strided and not t.is_nested
                and t.numel() > 0):
            found = not bool(torch.isfinite(t).all())
        return t

    map_tensors(host_batch, look)
    return found


def params_nonfinite(layers: Mapping[str, LayerStats] | None) -> bool | None:
    """``StepRecord.param_nonfinite`` of a step: True when a sampled module's parameter norm is
    nan/inf, False when every sampled one is finite, None on a step that was not sampled (the
    probes' norms are the only parameter check: a check every step would read every parameter
    every step; a non-finite parameter shows in the next step's loss anyway)."""
    norms = [st.param_norm for st in (layers or {}).values() if st.param_norm is not None]
    if not norms:
        return None
    return not all(math.isfinite(n) for n in norms)
