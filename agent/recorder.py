"""The per-step path of the agent: :class:`StepRecorder` turns hook calls and ``watch.step`` into
ring entries, records, snapshots and captures.

Order within one step (plain loop):

1. :meth:`StepRecorder.begin` at the first training forward: the localizer's forward-argument
   copy, a due snapshot, the RNG states (:class:`~.rngread.RngReader`).
2. :meth:`StepRecorder.grads_ready` at the optimizer step pre-hook: the fused global grad norm,
   on device; when the loop clips (``clip_grad_norm=``), the norm :meth:`StepRecorder.backward_done`
   took at the end of backward, before the clipping, and the record says whether it clipped.
3. :meth:`StepRecorder.record` at ``watch.step``: the batch copied to host once
   (:class:`~.ring.HostCopies`), the ring entry, the device values queued for readback; then
   records whose values landed are resolved (stream line, exporter, incident policy) and a due
   capture is started.

Methods raise on internal errors; the :class:`~.watch.Watch` front catches them and disables the
agent. Costs of each part: ``bench/step_profile.py``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from sentineld.contracts.records import AGENT_WARNING, AgentNotice, ReplicaDivergence, record_to_json
from sentineld.contracts.snapshot import state_of
from sentineld.contracts.stream import StreamWriter
from sentineld.contracts.triggers import NONFINITE, REPLICA_DIVERGENCE, SPIKE

from .agent_config import AgentConfig
from .capturer import CaptureWriter
from .diskring import DiskRingWriter
from .exporter import Latest, merge_layers
from .incidents import IncidentPolicy, batch_check, params_nonfinite
from .localize_live import LiveLocalizer
from .peers import PeerIncidents
from .readback import Readback, grad_norm
from .ring import HostCopies, Ring, RingEntry, Snapshot, to_host_sized
from .rngread import RngReader
from .sharded import to_host_sharded
from .snapshots import SnapshotSchedule

__all__ = ["StepRecorder"]

log = logging.getLogger("sentineld.agent")


class StepRecorder:
    """Per-step state of one watched model + optimizer.

    Args:
        model: the unwrapped model (snapshots and parameter names use it).
        optimizer, scheduler, scaler: as given to ``attach``.
        config: the agent's settings.
        stream, latest: where records go (JSON-lines stream, Prometheus exporter).
        writer: the capture writer; disk: the on-disk ring (None when off).
        live: the in-process localizer (None when off); probes: per-layer probes (None when off).
        rank: this process's rank; device: the model's device.
        peers: the DDP incident exchange (:mod:`.peers`), or None outside a multi-rank job.
        sharded: the model's parameters are FSDP2 DTensors (:mod:`.sharded`).
        clock, wall_clock: monotonic seconds (step time) and Unix seconds (record time).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: Any, *, config: AgentConfig, stream: StreamWriter, latest: Latest,
                 writer: CaptureWriter, disk: DiskRingWriter | None, live: LiveLocalizer | None,
                 probes: Any, rank: int, device: torch.device, clock: Callable[[], float],
                 wall_clock: Callable[[], float], peers: PeerIncidents | None = None,
                 clip_grad_norm: float | None = None, sharded: bool = False) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self._lazy_done = False
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._dup_warned = False
        self._batch_warned = False
        self.config, self.stream, self.latest, self.writer = config, stream, latest, writer
        self.disk, self.live, self.probes, self.rank, self.device = disk, live, probes, rank, device
        self._clock, self.wall = clock, wall_clock
        self.peers = peers  # DDP: other ranks' incidents (agent/peers.py), None in one process
        self.sharded = sharded  # FSDP2 parameters (DTensors): snapshots hold local shards
        self.ring = Ring(config.window, config.ring_bytes)
        self.schedule = SnapshotSchedule(config)
        # A spike capture is replayed from its own rank alone, which is not the step a
        # data-parallel run took (its gradients were all-reduced): no spike captures there yet.
        self.incidents = IncidentPolicy(config.rearm_steps, config.post_steps,
                                        config.spike_captures if peers is None else 0)
        self.readback = Readback()
        self.copies = HostCopies()
        if live is not None:
            live.copies = self.copies
        self._rng_reader = RngReader()
        self.n = 0
        self._t_last = clock()
        self.step_started = False
        self._rng: dict[str, Any] | None = None
        self.grads_carried: bool | None = None
        self.probe_checked = False
        self._gnorm: torch.Tensor | None = None
        self._pre_hook_ran = False
        self.clip_grad_norm = clip_grad_norm
        self._bw_norm: torch.Tensor | None = None  # pre-clip norm at the end of backward
        self._clip_max: float | None = None  # set: this step's norm is kept (taken before clipping)

    # ------------------------------------------------------------- hook side
    def begin(self, args: Any, kwargs: Any) -> None:
        """The step starts (first training forward, or a framework's ``begin_step``)."""
        if self.step_started:
            return
        self.step_started = True
        live = self.live
        # A step begun by a framework has no forward arguments to keep for forward-only
        # localization; that step's forward call is then simply not recorded.
        if live is not None and (args is not None or not live.forward_only):
            live.on_forward(self.n, args or (), kwargs or {}, self.schedule.due)
        if self.schedule.due:
            self.take_snapshot(self.n)
        self._rng = self._rng_reader.read()
        self.grads_carried = None
        self.probe_checked = False
        if self.probes is not None:
            self.probes.begin_step(self.n)

    def first_gradient(self, carried: bool | None) -> bool:
        """The step's first gradient arrived; ``carried``: whether the gradients held values from
        before the step (no ``zero_grad``), None when that cannot be told without a host sync.
        Returns False when this step's first gradient was seen already (nothing recorded)."""
        if self.probe_checked:
            return False
        self.probe_checked = True
        self.grads_carried = carried
        return True

    def number_from(self, step: int) -> None:
        """Number the next recorded step ``step`` (a framework's global step); the initial
        snapshot is dropped, to be taken again under that number (:meth:`initial_snapshot`).

        Raises:
            ValueError: a step already started or a snapshot or record was numbered.
        """
        if self.step_started or self.ring.entries:
            raise ValueError("start_at() must be called before the first step starts")
        self.n = int(step)
        self.ring.snapshots.clear()

    def drop_probes(self) -> None:
        """The per-layer probes were removed (the watch closes): no more samples."""
        self.probes = None

    def close_disk(self, remove: bool, timeout_s: float) -> None:
        """Close the on-disk ring (deleted when ``remove``); waits at most ``timeout_s`` seconds."""
        if self.disk is not None:
            self.disk.close(remove=remove, timeout_s=timeout_s)
            self.disk = None
    def backward_done(self) -> None:
        """A backward finished (the loop clips, ``clip_grad_norm=``): take the global grad norm
        now, before the loop clips it; unscaled by the GradScaler's scale on device (no sync).
        With accumulation the last micro-batch's backward gives the step's norm."""
        g = grad_norm(self.optimizer)
        scaler = self.scaler
        if g is not None and scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                g = g / scale.to(g.device, non_blocking=True).float().reshape(())
        self._bw_norm = g

    def grads_ready(self, norm: torch.Tensor | None = None, clip_max: float | None = None) -> None:
        """The gradients are complete: take the global grad norm (on device, no sync), or use
        the pre-clip one of :meth:`backward_done`.

        ``norm``: the framework's own value (the HF Trainer's clip returns it); ``clip_max``:
        the framework clips to this norm next, so this value is kept for the step (a later
        call, e.g. the optimizer's pre-hook, would see the clipped gradients)."""
        if self._clip_max is not None:
            return
        if norm is not None:
            self._gnorm = norm.detach().float().reshape(())
        elif self._bw_norm is not None:
            self._gnorm = self._bw_norm
        else:
            # On a full layer sample the probes' step pre-hook (after this one) reuses the
            # per-parameter norms instead of taking them again (agent/probes.py).
            probes = self.probes
            self._gnorm = grad_norm(self.optimizer, probes.grad_norms() if probes is not None else None)
        self._pre_hook_ran = True
        self._clip_max = clip_max

    # ------------------------------------------------------------------ step
    def record(self, loss: torch.Tensor | float, batch: Any) -> None:
        """Record one optimizer step (``watch.step``)."""
        if self._duplicate(loss):
            return
        n = self.n
        now = self._clock()
        step_s, self._t_last = now - self._t_last, now
        self.schedule.step_time(step_s)
        skipped = not self._pre_hook_ran
        gnorm = self._gnorm if self._pre_hook_ran else (
            self._bw_norm if self._bw_norm is not None else grad_norm(self.optimizer))
        forward_seen = self.step_started
        clip_max, self._clip_max = self._clip_max, None
        self._gnorm, self._pre_hook_ran, self.step_started, self._bw_norm = None, False, False, None
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        groups = self.optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        batch_sum, host_batch, nbytes = self._batch(batch)
        values: list[torch.Tensor | None] = [loss_t.float().reshape(()), gnorm,
                                             lr if isinstance(lr, torch.Tensor) else None, scale, batch_sum]
        self.copies.clear()
        entry = RingEntry(step=n, batch=host_batch, rng=self._rng, record=None, nbytes=nbytes)
        self._rng = None
        self.ring.add_step(entry)
        probes = self.probes
        layers = probes.collect() if probes is not None else None
        if layers:
            self.latest.layers = merge_layers(self.latest.layers, layers)
        elif probes is not None and probes.failure is not None:  # once: say it where the daemon reads
            self.stream.put(AgentNotice(AGENT_WARNING, probes.failure, n).to_json(), urgent=True)
            self.probes = None
        fields = {"step": n, "step_s": step_s, "time_s": self.wall(), "optimizer_skipped": skipped,
                  "layers": layers or None, "param_nonfinite": params_nonfinite(layers),
                  "rank": self.rank, "grads_carried": self.grads_carried,
                  "lr": float(lr) if lr is not None and not isinstance(lr, torch.Tensor) else None,
                  "clip_grad_norm": clip_max if clip_max is not None else self.clip_grad_norm}
        event = self.readback.push(n, values, fields, entry)
        replicas = self.peers.replicas if self.peers is not None else None
        if replicas is not None and replicas.due(n):
            replicas.sample(n)  # after this step's optimizer step (agent/replicas.py)
        self.n += 1
        self._after(entry, event, forward_seen)

    def _batch(self, batch: Any) -> tuple[torch.Tensor | None, Any, int]:
        """``(batch sum, host copy, bytes)`` of the step's batch; a batch the agent cannot walk
        or copy (one that holds itself, nests past the recursion limit, holds a meta tensor)
        is recorded as None with one warning: it cost the whole agent before."""
        try:
            batch_sum = batch_check(batch)
            host_batch, nbytes = self.copies.copy(batch)
            return batch_sum, host_batch, nbytes
        except Exception as exc:  # noqa: BLE001 - the step is still recorded, without its batch
            self.copies.clear()
            if not self._batch_warned:
                self._batch_warned = True
                msg = f"batch not kept (the step is recorded without it): {type(exc).__name__}: {str(exc)[:200]}"
                log.warning("sentineld: %s", msg)
                self.stream.put(AgentNotice(AGENT_WARNING, msg, self.n).to_json(), urgent=True)
            return None, None, 0

    def _duplicate(self, loss: torch.Tensor | float) -> bool:
        """True for a second ``watch.step`` of one step: the same loss tensor again, with no
        forward and no optimizer step since the last call. Recorded, it would number a step
        that did not happen, as an optimizer step skipped (a false "skipped steps" alert) and
        shift every later step number off the loop's. Logged once; the call is ignored."""
        last, self._last_loss = self._last_loss, (weakref.ref(loss) if isinstance(loss, torch.Tensor) else None)
        if last is None or last() is not loss or self._pre_hook_ran or self.step_started:
            return False
        if not self._dup_warned:
            self._dup_warned = True
            msg = ("watch.step called again for the same step (same loss, no forward or optimizer step "
                   "since); the extra calls are ignored: call it once per optimizer step")
            log.warning("sentineld: %s", msg)
            self.stream.put(AgentNotice(AGENT_WARNING, msg, self.n - 1).to_json(), urgent=True)
        return True

    def _after(self, entry: RingEntry, event: Any, forward_seen: bool) -> None:
        replicas = self.peers.replicas if self.peers is not None else None
        self.resolve_ready()
        if self.disk is not None:
            self.disk.add_step(entry, event)
        if self.incidents.due(self.n - 1):
            self.flush_incident()
        if self.peers is not None and self.peers.requests:
            self.peer_captures()
        if replicas is not None and replicas.divergences:
            self.replica_captures()
        if self.n % 16 == 1:  # cadence drifts slowly; re-derive it now and then, not per step
            self.schedule.tune(self.ring.entries[-1].nbytes if self.ring.entries else 0,
                               self.disk.snapshot_cost_s if self.disk is not None else 0.0)
        self.schedule.step_done(self.incidents.latched)
        if not forward_seen:
            # A loop that never calls model(...) itself (Lightning's training_step, a method of
            # the model): the end of this step is the start of the next one.
            if self.schedule.due:
                self.take_snapshot(self.n)
            self._rng = self._rng_reader.read()

    def resolve_ready(self) -> None:
        """Turn every step whose values landed into its record: stream, exporter, incidents."""
        for record, entry, _step in self.readback.ready():
            obj = record_to_json(record)
            entry.record = obj
            lt = self.latest
            lt.record = record
            lt.steps_total += 1
            lt.skipped_total += int(record.optimizer_skipped)
            bad, opened = self.incidents.observe(record)
            lt.nonfinite_total += int(bad)
            self.stream.put(obj, urgent=bad)
            if opened is not None and opened.trigger == NONFINITE and self.peers is not None:
                self.peers.publish(opened.step)  # other ranks capture this step too

    # ------------------------------------------------------------- snapshots
    def initial_snapshot(self) -> None:
        """The state before the first step, so a fault in the first steps has a clean snapshot
        (see :mod:`.snapshots`); RAM ring only, replaced by the first step's own snapshot.
        Skipped while a lazy module is not initialized (its parameters have no values before
        the first forward; the first snapshot due after it is then the first one)."""
        self.take_snapshot(self.n, initial=True)
        self._rng = self._rng_reader.read()

    def _lazy_pending(self) -> bool:
        """True while a lazy module's parameters have no values (before its first forward,
        which runs after the step's forward pre-hook): no snapshot can copy them yet."""
        if self._lazy_done:
            return False
        is_lazy = torch.nn.parameter.is_lazy
        pending = any(is_lazy(t) for t in (*self.model.parameters(), *self.model.buffers()))
        self._lazy_done = not pending
        return pending

    def take_snapshot(self, step: int, initial: bool = False) -> None:
        """Copy model + optimizer (+ scheduler, scaler, carried grads) state to host as the state
        before ``step``; async from CUDA, with an event the writers wait on. ``initial``: the
        one at attach (not written to the on-disk ring, and the cadence does not restart)."""
        if self._lazy_pending():
            return
        t0 = self._clock()
        # Gradients are part of the state only in a loop that does not zero them before the
        # forward (no zero_grad, or accumulation across steps): then the next step adds to them.
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        state = state_of(self.model, self.optimizer, self.scheduler, self.scaler, grads)
        # FSDP2: each rank copies its own shards only (agent/sharded.py), never the whole parameter.
        host, nbytes = to_host_sharded(state) if self.sharded else to_host_sized(state)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        snap = Snapshot(step=step, state=host, event=event, nbytes=nbytes)
        self.ring.add_snapshot(snap)
        if self.disk is not None and not initial:
            self.disk.add_snapshot(snap)
        self.schedule.taken(self._clock() - t0, initial=initial)

    # -------------------------------------------------------------- captures
    def flush_incident(self) -> None:
        """Start the open incident's capture, if any (at its due step, or at close)."""
        inc = self.incidents.take()
        if inc is None:
            return
        last = self.ring.entries[-1].step if self.ring.entries else inc.step
        self.capture(inc.trigger, inc.step, inc.message, last=max(inc.step, last))

    def capture(self, trigger: str, step: int, message: str, last: int | None = None) -> None:
        """Start writing a capture from ``step`` to ``last`` (default ``step``) out of the ring."""
        end = step if last is None else last
        # A snapshot taken at step N holds the state step N-1 made: when N-1's optimizer step
        # broke the parameters (seen only in N's loss) it is already corrupt, so prefer the one before.
        ring = self.ring
        span = (ring.span(end, before=step - 1) if step > 0 else None) or ring.span(end, before=step)
        if trigger == SPIKE and step > 1:
            # The spike replay compares the update that made the spiking state with the one
            # before it: a snapshot two steps back when the ring holds one.
            span = ring.span(end, before=step - 2) or span
        if span is None:
            log.warning("sentineld: step %d is not in the ring buffer (window %d); no capture",
                        step, self.config.window)
            why = "no clean snapshot in the ring; capture skipped"
            self.stream.put(AgentNotice(AGENT_WARNING, why, step).to_json(), urgent=True)
            return
        snap, entries = span
        self.writer.start(trigger, step, snap, entries, message)

    def replica_captures(self) -> None:
        """Capture the steps after which the ranks' replicas differed (agent/replicas.py)."""
        replicas = self.peers.replicas if self.peers is not None else None
        for div in replicas.take() if replicas is not None else []:
            msg = div.message(replicas.world)  # type: ignore[union-attr]
            log.warning("sentineld: %s", msg)
            line = ReplicaDivergence(div.step, tuple(div.ranks), div.parameter, msg)
            self.stream.put(line.to_json(), urgent=True)
            last = self.ring.entries[-1].step if self.ring.entries else div.step
            self.capture(REPLICA_DIVERGENCE, div.step, msg, last=max(div.step, last))

    def peer_captures(self) -> None:
        """Capture the steps where another rank opened an incident (agent/peers.py)."""
        for step, rank in self.peers.take() if self.peers is not None else []:
            last = self.ring.entries[-1].step if self.ring.entries else step
            self.capture(NONFINITE, step, f"rank {rank} went non-finite at step {step}: this rank's "
                         "capture of the step, for the DDP replay", last=max(step, last))
