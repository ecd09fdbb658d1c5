"""The agent's one object in the training process: hooks, per-step record, ring buffer, captures.

Quickstart (two added lines)::

    watch = sentineld.agent.attach(model, optimizer, run_id="exp1", recipe="train:make_recipe")
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        watch.step(loss, batch=(x, y))

What happens where, and why:

- model forward pre-hook (first training forward of a step): RNG states are read, because that
  is what dropout and in-model noise draw from; a due snapshot is taken, because that is exactly
  "the state before this step" wherever the loop steps its scheduler.
- optimizer step pre-hook: global grad norm with fused ``torch._foreach_norm`` (one kernel per
  device and dtype), before the optimizer changes anything.
- ``watch.step``: copies the batch to host, records the step, and on CPU reads values at once.
  On CUDA, values are copied non-blocking into pinned memory with an event and read when the event
  has completed (normally one step later): no host-device sync is added to the step.

Framework callbacks (:mod:`sentineld.integrations`) feed the same steps from the framework's own
points through :meth:`Watch.begin_step`, :meth:`Watch.grads_ready` and :meth:`Watch.start_at`.

The parts, each owning its state: :mod:`.readback` (values to records), :mod:`.snapshots`
(cadence), :mod:`.incidents` (when to capture), :mod:`.capturer` (the writer thread),
:mod:`.runfiles` (run directory, run.json, stream), :mod:`.diskring` (the on-disk ring).

The agent never raises into the loop: an internal error is logged once and the agent disables
itself (``watch.enabled`` becomes False), leaving model and optimizer as they were.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from sentineld.contracts.records import record_to_json
from sentineld.contracts.rng import capture_rng
from sentineld.contracts.rundir import RunDir, default_runs_dir, valid_run_id
from sentineld.contracts.snapshot import state_of
from sentineld.contracts.triggers import CRASH, MANUAL

from .agent_config import AgentConfig
from .capturer import CaptureWriter
from .diskring import DiskRingWriter
from .exits import EXITS
from .exporter import Latest, start_exporter
from .incidents import IncidentPolicy, batch_check, params_nonfinite
from .localize_live import make_localizer
from .readback import Readback, grad_norm
from .ring import Ring, RingEntry, Snapshot, to_host, tree_nbytes
from .runfiles import open_run_files
from .runinfo import default_run_id, dist_rank, unwrap
from .snapshots import SnapshotSchedule

__all__ = ["Watch"]

log = logging.getLogger("sentineld.agent")


class Watch:
    """Watches one model + optimizer in the training process. Build it with :func:`attach`.

    Attributes:
        run_id, rank, run_dir: where this run's files go.
        metrics_port: the bound Prometheus port, or None when export is off.
        enabled: False once the agent disabled itself after an internal error.
        captures: paths of captures written so far.
        snapshot_every: current snapshot cadence in steps (chosen in auto mode after warm-up).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str | None = None,
        runs_dir: str | os.PathLike[str] | None = None,
        recipe: str | None = None,
        recipe_args: dict[str, Any] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        num_classes: int | None = None,
        accumulation_steps: int = 1,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        localize: str = "thread",
        clip_grad_norm: float | None = None,
        config: AgentConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        run_id = _check_args(model, optimizer, run_id, recipe, recipe_args)
        self.config = config or AgentConfig()
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        # DDP/FSDP-style wrappers hold the real model in .module: snapshots and parameter names
        # use it, so the replay's plain model loads them without a "module." prefix.
        self._inner = unwrap(model)
        self.rank, world, local_rank = dist_rank()
        self._clock, self._wall = clock, wall_clock
        self._accumulating = accumulation_steps > 1
        self._live = make_localizer(localize, self._inner, optimizer, loss_fn, recipe, self.config.window,
                                    run_id, scheduler=scheduler, scaler=scaler, num_classes=num_classes,
                                    accumulation_steps=accumulation_steps, clip_grad_norm=clip_grad_norm,
                                    max_bytes=self.config.ring_bytes)
        files = open_run_files(Path(runs_dir or default_runs_dir()), run_id, self.rank, world,
                               recipe=recipe, recipe_args=dict(recipe_args or {}),
                               num_classes=num_classes, flush_s=self.config.flush_s,
                               wall_clock=wall_clock, extra=self._run_extra(localize))
        self.run_id, self.run_dir, self.stream, self.enabled = files.run_id, files.run_dir, files.stream, files.ok
        if self._live is not None:
            self._live.run_id = self.run_id
        self.latest = Latest()
        self._server, self.metrics_port = self._start_exporter(local_rank)
        self._ring = Ring(self.config.window, self.config.ring_bytes)
        self._closed = False
        # Imported now, not at the first capture: the exit paths (atexit, excepthook) write
        # captures, and a first `import h5py` from an atexit handler segfaults (h5py 3.16).
        import h5py  # noqa: F401, PLC0415
        for stale in RunDir(self.run_dir).unfinished_captures(self.rank):
            stale.unlink(missing_ok=True)  # a capture a killed process of this rank never finished
        self._disk = self._start_disk_ring()
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._writer = CaptureWriter(self.run_dir, self.run_id, self.rank, self._device, self.stream,
                                     self.latest, localizer=self._live)
        self._schedule = SnapshotSchedule(self.config)
        self._incidents = IncidentPolicy(self.config.rearm_steps, self.config.post_steps)
        self._readback = Readback()
        self._n = 0
        self._t_last = clock()
        self._step_started = False
        self._rng: dict[str, Any] | None = None
        self._grads_carried: bool | None = None
        self._probe_checked = False
        self._gnorm: torch.Tensor | None = None
        self._pre_hook_ran = False
        self._install_hooks()
        self._initial_snapshot()
        EXITS.register(self)

    def _initial_snapshot(self) -> None:
        """The state before step 0, so a fault in the first steps has a clean snapshot (see
        :meth:`SnapshotSchedule.initial`); RAM ring only, and replaced by the first forward's."""
        try:
            self._take_snapshot(self._n, initial=True)
            self._rng = capture_rng()
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            self._disable(exc)

    def _run_extra(self, localize: str) -> dict[str, Any]:
        """run.json's in-process localization fields (read by the daemon and the forward-only replay)."""
        live = self._live
        return {"localize": localize if live else "off",
                "localize_memory_bytes": live.memory_bytes if live else 0,
                "model_class": f"{type(self._inner).__module__}:{type(self._inner).__qualname__}"}

    def _start_exporter(self, local_rank: int) -> tuple[Any, int | None]:
        if self.config.metrics_port == 0 or not self.enabled:
            return None, None
        port = self.config.metrics_port + (local_rank if self.config.metrics_port > 0 else 0)
        try:
            return start_exporter(self.latest, self.run_id, self.rank, port, self.config.metrics_addr)
        except OSError as exc:
            log.warning("sentineld: metrics export off: %s", exc)
            return None, None

    def _start_disk_ring(self) -> DiskRingWriter | None:
        if not self.config.disk_ring:
            return None
        try:
            return DiskRingWriter(
                self.run_dir, self.rank, self.config.window,
                meta={"run_id": self.run_id, "torch_version": str(torch.__version__)},
                on_warning=lambda text: self.stream.put(
                    {"kind": "agent_warning", "message": text}, urgent=True))
        except OSError as exc:
            log.warning("sentineld: on-disk ring off: %s", exc)
            return None

    def _install_hooks(self) -> None:
        model, optimizer = self.model, self.optimizer
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._probe_param = min((p for p in model.parameters() if p.requires_grad and id(p) in opt_params),
                                key=lambda p: p.numel(), default=None)
        self._hooks = [
            model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
            optimizer.register_step_pre_hook(self._on_optimizer_step),
        ]
        if self._probe_param is not None and not self._accumulating:
            # Old gradient still in .grad when this step's gradient arrives = not zeroed. Checked
            # here, not at the forward, so zero_grad() between forward and backward is fine.
            self._hooks.append(self._probe_param.register_hook(self._on_probe_grad))
        self._probes = None
        if self.config.layer_every > 0:
            from .probes import attach_probes  # noqa: PLC0415

            self._probes = attach_probes(self._inner, optimizer, every=self.config.layer_every)

    @property
    def captures(self) -> list[Path]:
        """Paths of the captures written so far."""
        return self._writer.captures

    @property
    def snapshot_every(self) -> int:
        """Current snapshot cadence in steps."""
        return self._schedule.every

    # ----------------------------------------------------------------- hooks
    def _on_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._begin(args, kwargs)

    def begin_step(self) -> None:
        """Mark the start of a training step: take a due snapshot and read the RNG states.

        The model's forward pre-hook does this at the first training forward of a step. A
        framework callback calls it where its step starts when the framework never calls the
        model itself (Lightning's ``training_step``): at the first micro-batch of each optimizer
        step, before its forward. Later calls in the same step do nothing. Never raises.
        """
        self._begin(None, None)

    def _begin(self, args: Any, kwargs: Any) -> None:
        if not self.enabled or self._step_started:
            return
        try:
            self._step_started = True
            # A step begun by a framework has no forward arguments to keep for forward-only
            # localization; that step's forward call is then simply not recorded.
            if self._live is not None and (args is not None or not self._live.forward_only):
                self._live.on_forward(self._n, args or (), kwargs or {}, self._schedule.due)
            if self._schedule.due:
                self._take_snapshot(self._n)
            self._rng = capture_rng()
            self._grads_carried = None
            self._probe_checked = False
            if self._probes is not None:
                self._probes.begin_step(self._n)
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            self._disable(exc)

    def _on_probe_grad(self, grad: torch.Tensor) -> None:
        if not self.enabled or self._probe_checked:
            return
        try:
            self._probe_checked = True
            p = self._probe_param
            if p is not None and p.device.type == "cpu":  # on CUDA .any() would sync: unknown
                self._grads_carried = p.grad is not None and bool(p.grad.any())
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.grads_ready()

    def grads_ready(self) -> None:
        """Take this step's global grad norm now: the gradients are complete, not yet clipped.

        The optimizer's step pre-hook does this. A framework that runs forward and backward
        inside ``optimizer.step(closure)`` (Lightning) runs that pre-hook before the closure, on
        the previous step's gradients; its callback calls this again once the closure is done
        (``on_before_optimizer_step``), and the later value is the one recorded. Never raises.
        """
        if not self.enabled:
            return
        try:
            self._gnorm = grad_norm(self.optimizer)
            self._pre_hook_ran = True
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def start_at(self, step: int) -> None:
        """Number the next recorded step ``step`` instead of 0; call before the first step starts.

        A framework callback passes its trainer's global step, so a resumed run's stream,
        snapshots and captures use the trainer's step numbers.

        Raises:
            ValueError: ``step`` is negative, or a step already started.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._step_started or self._ring.entries:  # a snapshot or record already numbered
            raise ValueError("start_at() must be called before the first step starts")
        self._n = int(step)
        self._ring.snapshots.clear()  # the initial snapshot, numbered again
        self._initial_snapshot()

    # ------------------------------------------------------------------ step
    def step(self, loss: torch.Tensor | float, batch: Any = None) -> None:
        """Record one optimizer step. Call once per step, after ``optimizer.step()``.

        Args:
            loss: the step's loss (scalar tensor or float); with accumulation, the last
                micro-batch's as returned by the loss function.
            batch: what the loss function took: a tensor or a tree (tuple/list/dict) of tensors
                and plain values; a list of micro-batches when accumulating. Copied to host memory.

        Never raises; after an internal error the agent disables itself (see ``enabled``).
        """
        if not self.enabled:
            if self._hooks:
                self._remove_hooks()
            return
        try:
            self._record(loss, batch)
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)
            self._remove_hooks()

    def _record(self, loss: torch.Tensor | float, batch: Any) -> None:
        n = self._n
        now = self._clock()
        step_s, self._t_last = now - self._t_last, now
        self._schedule.step_time(step_s)
        gnorm = self._gnorm if self._pre_hook_ran else grad_norm(self.optimizer)
        skipped = not self._pre_hook_ran
        forward_seen = self._step_started
        self._gnorm, self._pre_hook_ran, self._step_started = None, False, False
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        values: list[torch.Tensor | None] = [loss_t.float().reshape(()), gnorm,
                                             lr if isinstance(lr, torch.Tensor) else None, scale,
                                             batch_check(batch)]
        host_batch = to_host(batch)
        entry = RingEntry(step=n, batch=host_batch, rng=self._rng, record=None,
                          nbytes=tree_nbytes(host_batch))
        self._rng = None
        self._ring.add_step(entry)
        layers = self._probes.collect() if self._probes is not None else None
        if layers:
            self.latest.layers = dict(layers)
        fields = {"step": n, "step_s": step_s, "time_s": self._wall(), "optimizer_skipped": skipped,
                  "layers": layers or None, "param_nonfinite": params_nonfinite(layers),
                  "rank": self.rank, "grads_carried": self._grads_carried,
                  "lr": float(lr) if lr is not None and not isinstance(lr, torch.Tensor) else None}
        event = self._readback.push(n, values, fields, entry)
        self._n += 1
        self._after_step(entry, event, forward_seen)

    def _after_step(self, entry: RingEntry, event: Any, forward_seen: bool) -> None:
        self._resolve_ready()
        if self._disk is not None:
            self._disk.add_step(entry, event)
        if self._incidents.due(self._n - 1):
            self._flush_incident()
        if self._n % 16 == 1:  # cadence drifts slowly; re-derive it now and then, not per step
            self._schedule.tune(self._ring.entries[-1].nbytes if self._ring.entries else 0)
        self._schedule.step_done(self._incidents.latched)
        if not forward_seen:
            # A loop that never calls model(...) itself (Lightning's training_step, a method of
            # the model): the end of this step is the start of the next one.
            if self._schedule.due:
                self._take_snapshot(self._n)
            self._rng = capture_rng()

    def _resolve_ready(self) -> None:
        for record, entry, step in self._readback.ready():
            obj = record_to_json(record)
            entry.record = obj
            lt = self.latest
            lt.record = record
            lt.steps_total += 1
            lt.skipped_total += int(record.optimizer_skipped)
            bad, opened = self._incidents.observe(record)
            lt.nonfinite_total += int(bad)
            self.stream.put(obj, urgent=bad)
            if opened is not None and step == self._n - 1:
                opened.grads = self._grads_now()

    def _grads_now(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self._inner.named_parameters()}
        return {names.get(id(p), f"param{i}"): p.grad.detach().to("cpu", copy=True)
                for i, p in enumerate(q for g in self.optimizer.param_groups for q in g["params"])
                if p.grad is not None}

    # ------------------------------------------------------------- snapshots
    def _take_snapshot(self, step: int, initial: bool = False) -> None:
        t0 = self._clock()
        # Gradients are part of the state only in a loop that does not zero them before the
        # forward (no zero_grad, or accumulation across steps): then the next step adds to them.
        grads = {n: p.grad for n, p in self._inner.named_parameters() if p.grad is not None}
        host = to_host(state_of(self._inner, self.optimizer, self.scheduler, self.scaler, grads))
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        snap = Snapshot(step=step, state=host, event=event, nbytes=tree_nbytes(host))
        self._ring.add_snapshot(snap)
        if self._disk is not None and not initial:
            self._disk.add_snapshot(snap)
        self._schedule.taken(self._clock() - t0, initial=initial)

    # -------------------------------------------------------------- captures
    def _flush_incident(self) -> None:
        inc = self._incidents.take()
        if inc is None:
            return
        last = self._ring.entries[-1].step if self._ring.entries else inc.step
        self._capture(inc.trigger, inc.step, inc.grads, inc.message, last=max(inc.step, last))

    def _capture(self, trigger: str, step: int, grads: dict[str, torch.Tensor] | None,
                 message: str, last: int | None = None) -> None:
        end = step if last is None else last
        # A snapshot taken at step N holds the state step N-1 made: when N-1's optimizer step
        # broke the parameters (seen only in N's loss) it is already corrupt, so prefer the one before.
        span = (self._ring.span(end, before=step - 1) if step > 0 else None) or self._ring.span(end, before=step)
        if span is None:
            log.warning("sentineld: step %d is not in the ring buffer (window %d); no capture",
                        step, self.config.window)
            self.stream.put({"kind": "agent_warning", "step": step,
                             "message": "no clean snapshot in the ring; capture skipped"}, urgent=True)
            return
        snap, entries = span
        self._writer.start(trigger, step, snap, entries, grads, message)

    def capture_now(self, trigger: str = MANUAL, message: str = "") -> None:
        """Write the ring buffer as a capture ending at the newest step (e.g. before a risky change)."""
        if not self.enabled or not self._ring.entries:
            return
        self._flush_incident()
        self._capture(trigger, self._ring.entries[-1].step, None, message)

    # -------------------------------------------------------------- lifetime
    def _disable(self, exc: BaseException) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.latest.enabled = False
        log.error("sentineld: agent disabled after an internal error (training continues): %r", exc)
        try:
            self.stream.put({"kind": "agent_error", "message": repr(exc)}, urgent=True)
        except Exception:  # noqa: BLE001
            pass
        # Hooks are not removed here: this may run inside Optimizer.step's loop over its hooks,
        # which must not change size. Disabled hooks return at once; step() and close() remove them.

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        probes = getattr(self, "_probes", None)
        if probes is not None:
            probes.remove()
            self._probes = None

    def close(self, reason: str = "finished", timeout_s: float = 120.0) -> None:
        """Detach hooks, finish pending records and captures, stop the exporter and the stream.

        Args:
            reason: written to the stream's ``end`` record (``finished``, ``crashed`` or
                ``terminated``).
            timeout_s: most seconds to wait for captures being written.

        Safe to call more than once. The on-disk ring is deleted on a clean finish or once a
        crash capture was written; otherwise it stays for ``sentineld recover``.
        """
        if self._closed:
            return
        self._closed = True
        EXITS.unregister(self)
        self._remove_hooks()
        if self.enabled:
            try:
                self._readback.wait_all()
                self._resolve_ready()
                self._flush_incident()
            except Exception as exc:  # noqa: BLE001
                self._disable(exc)
        deadline = time.monotonic() + timeout_s
        self._writer.join(deadline)
        if self._disk is not None:
            self._disk.close(remove=reason == "finished" or self._writer.crash_captured,
                             timeout_s=max(0.0, deadline - time.monotonic()))
            self._disk = None
        self.stream.put({"kind": "end", "reason": reason, "steps": self._n, "time_s": self._wall()})
        self.stream.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.enabled = False

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._crash(f"{type(exc).__name__}: {exc}", "crashed")
        self.close("finished")

    def _crash(self, message: str, reason: str, timeout_s: float = 120.0) -> None:
        """Write a ``crash`` capture of the ring (when enabled) and close with ``reason``."""
        if self._closed:
            return
        if self.enabled and self.config.capture_on_crash:
            try:
                self.capture_now(CRASH, message)
            except Exception as err:  # noqa: BLE001
                log.warning("sentineld: crash capture failed: %r", err)
        self.close(reason, timeout_s=timeout_s)


def _check_args(model: Any, optimizer: Any, run_id: str | None, recipe: str | None,
                recipe_args: dict[str, Any] | None) -> str:
    """The run id to use; raises TypeError/ValueError naming a bad argument."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    run_id = run_id or default_run_id()
    if not valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
    if recipe is not None and ":" not in recipe:
        raise ValueError(f"recipe must be 'module:function', got {recipe!r}")
    try:
        json.dumps(dict(recipe_args or {}), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"recipe_args must be JSON values (str, numbers, bools, lists, dicts): {exc}") from None
    return run_id
