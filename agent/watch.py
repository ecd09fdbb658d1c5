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

The parts, each owning its state: :mod:`.recorder` (the per-step path: ring, snapshots, records,
captures), :mod:`.readback` (values to records), :mod:`.snapshots` (cadence), :mod:`.incidents`
(when to capture), :mod:`.capturer` (the writer thread), :mod:`.runfiles` (run directory,
run.json, stream), :mod:`.diskring` (the on-disk ring), :mod:`.wiring` (building them at attach).
This class is the thin front: hooks, the public calls, and the "never raise into the loop" rule.

The agent never raises into the loop: an internal error is logged once and the agent disables
itself (``watch.enabled`` becomes False), leaving model and optimizer as they were.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from sentineld.contracts.records import AGENT_ERROR, AgentNotice, EndLine
from sentineld.contracts.rundir import RunDir, default_runs_dir
from sentineld.contracts.triggers import CRASH, MANUAL

from . import localize_live
from .agent_config import AgentConfig
from .capturer import CaptureWriter
from .exits import EXITS
from .exporter import Latest
from .localize_live import make_localizer
from .memory import memory_bound
from .peers import peer_incidents
from .recorder import StepRecorder
from .ring import Ring
from .runfiles import open_run_files
from .runinfo import dist_rank, is_compiled, model_kind, unwrap
from .sharded import model_is_sharded, sharded_saver
from .wiring import check_args, check_signatures, record_metrics_port, run_extra, start_disk_ring, start_metrics

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
        memory: upper bound of the ring's host memory (:class:`~.memory.MemoryBound`).
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
        localize: str = "auto",
        clip_grad_norm: float | None = None,
        signatures: dict[str, dict[str, Any]] | None = None,
        config: AgentConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        run_id = check_args(model, optimizer, run_id, recipe, recipe_args)
        extra = {"signatures": check_signatures(signatures)} if signatures else {}
        cfg = self.config = config or AgentConfig()
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        # DDP/FSDP-style wrappers hold the real model in .module: snapshots and parameter names
        # use it, so the replay's plain model loads them without a "module." prefix.
        self._inner = unwrap(model)
        self.rank, world, local_rank = dist_rank()
        sharded = self._sharded = model_is_sharded(self._inner)
        if sharded and cfg.snapshot_every == 0:
            # The ranks' shards of one checkpoint must come from the same step: the auto cadence
            # is tuned per rank from its own step times, so an FSDP2 run snapshots at a fixed one.
            cfg = self.config = replace(cfg, snapshot_every=min(cfg.min_snapshot_every, cfg.window // 2))
        self._accumulating = accumulation_steps > 1
        self._live = make_localizer(localize, self._inner, optimizer, loss_fn, recipe, cfg.window,
                                    run_id, scheduler=scheduler, scaler=scaler, num_classes=num_classes,
                                    accumulation_steps=accumulation_steps, clip_grad_norm=clip_grad_norm,
                                    max_bytes=cfg.ring_bytes)
        files = open_run_files(Path(runs_dir or default_runs_dir()).expanduser(), run_id, self.rank, world,
                               recipe=recipe, recipe_args=dict(recipe_args or {}),
                               num_classes=num_classes, flush_s=cfg.flush_s,
                               wall_clock=wall_clock,
                               extra={**run_extra(self._live, localize, self._inner), **extra,
                                      **model_kind(model, sharded)})
        self.run_id, self.run_dir, self.stream, self.enabled = files.run_id, files.run_dir, files.stream, files.ok
        if self._live is not None:
            self._live.run_id = self.run_id
        self.memory = memory_bound(self._inner, optimizer, cfg, bool(self._live and self._live.forward_only))
        self.latest = Latest(ring_bound_bytes=self.memory.total)
        self._server, self.metrics_port = start_metrics(cfg, self.latest, self.run_id, self.rank,
                                                        local_rank, self.enabled)
        if self.metrics_port is not None:
            record_metrics_port(self.run_dir, self.rank, self.metrics_port)
        self._closed = False
        # Imported now, not at the first capture: the exit paths (atexit, excepthook) write
        # captures, and a first `import h5py` from an atexit handler segfaults (h5py 3.16).
        import h5py  # noqa: F401, PLC0415
        for stale in RunDir(self.run_dir).unfinished_captures(self.rank):
            stale.unlink(missing_ok=True)  # a capture a killed process of this rank never finished
        disk = start_disk_ring(cfg, self.run_dir, self.rank, self.run_id, self.stream)
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._writer = CaptureWriter(self.run_dir, self.run_id, self.rank, self._device, self.stream,
                                     self.latest, localizer=self._live)
        if sharded and self.enabled:
            self._writer.sharded = sharded_saver(self._inner, self.rank, world)
        self._install_hooks(clip_grad_norm if world == 1 else None)
        self._rec = StepRecorder(self._inner, optimizer, scheduler, scaler, config=cfg, stream=self.stream,
                                 clip_grad_norm=clip_grad_norm,
                                 latest=self.latest, writer=self._writer, disk=disk, live=self._live,
                                 probes=self._probes, rank=self.rank, device=self._device,
                                 clock=clock, wall_clock=wall_clock,
                                 peers=peer_incidents(self.run_id, self.rank, world, None if sharded else self._inner,
                                                      cfg.replica_every) if self.enabled else None,
                                 sharded=sharded)
        log.info("sentineld: run %s rank %d: %s", self.run_id, self.rank, self.memory.describe())
        self._initial_snapshot()
        EXITS.register(self)

    def _initial_snapshot(self) -> None:
        if not self.enabled:
            return
        try:
            self._rec.initial_snapshot()
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            self._disable(exc)

    def _install_hooks(self, clip_grad_norm: float | None = None) -> None:
        model, optimizer = self.model, self.optimizer
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        # A lazy (uninitialized) parameter has no numel until the first forward: not a probe.
        self._probe_param = min((p for p in model.parameters() if p.requires_grad and id(p) in opt_params
                                 and not torch.nn.parameter.is_lazy(p)),
                                key=lambda p: p.numel(), default=None)
        self._hooks = [
            # FSDP2's own pre-forward hook unshards the parameters; a state_dict() after it (the
            # snapshot) registers the shards back mid-forward. Ours runs first on a sharded model.
            model.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=self._sharded),
            optimizer.register_step_pre_hook(self._on_optimizer_step),
        ]
        if self._probe_param is not None and not self._accumulating:
            # Old gradient still in .grad when this step's gradient arrives = not zeroed. Checked
            # here, not at the forward, so zero_grad() between forward and backward is fine.
            self._hooks.append(self._probe_param.register_hook(self._on_probe_grad))
        if clip_grad_norm is not None and self._probe_param is not None:
            # The loop clips before optimizer.step(): the grad norm is taken at the end of each
            # backward instead, pre-clip (issue 21: a clipped norm is a flat max_norm, and
            # exploding_gradients could never fire). One process only: under DDP the end of
            # backward may come before the reducer wrote the averaged gradients.
            self._hooks.append(self._probe_param.register_hook(self._on_backward))
        self._probes = None
        if self.config.layer_every > 0 and is_compiled(model):
            # Probe hooks inside a compiled module change its guards: each sampled step would
            # recompile (and after dynamo's recompile limit run the model eagerly for good).
            # A compiled model gets the per-step scalars only; its hooks are outside the graph.
            log.info("sentineld: per-layer probes are off for a torch.compile'd model (they would "
                     "recompile it on sampled steps); step scalars, snapshots and captures are on")
        elif self.config.layer_every > 0:
            from .probes import attach_probes  # noqa: PLC0415

            self._probes = attach_probes(self._inner, optimizer, every=self.config.layer_every)

    @property
    def captures(self) -> list[Path]:
        """Paths of the captures written so far."""
        return self._writer.captures

    @property
    def snapshot_every(self) -> int:
        """Current snapshot cadence in steps."""
        return self._rec.schedule.every

    @property
    def _ring(self) -> Ring:
        return self._rec.ring

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
        if not self.enabled:
            return
        try:
            self._rec.begin(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            self._disable(exc)

    def _on_probe_grad(self, grad: torch.Tensor) -> None:
        if not self.enabled or self._rec.probe_checked:
            return
        try:
            p = self._probe_param
            carried = None  # on CUDA .any() would sync: unknown
            if p is not None and p.device.type == "cpu":
                carried = p.grad is not None and bool(p.grad.any())
            self._rec.first_gradient(carried)
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def _on_backward(self, grad: torch.Tensor) -> None:
        if self.enabled:  # the probe's gradient is computed: the rest of this backward follows
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)  # type: ignore[attr-defined]

    def _backward_done(self) -> None:
        if not self.enabled:
            return
        try:
            self._rec.backward_done()
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.grads_ready()

    def grads_ready(self, norm: torch.Tensor | None = None, clip_max: float | None = None) -> None:
        """Take this step's global grad norm now: the gradients are complete, not yet clipped.

        The optimizer's step pre-hook does this. A framework that runs forward and backward
        inside ``optimizer.step(closure)`` (Lightning) runs that pre-hook before the closure, on
        the previous step's gradients; its callback calls this again once the closure is done
        (``on_before_optimizer_step``), and the later value is the one recorded. Never raises.

        Args:
            norm: the global grad norm the framework computed itself (shape ``()``, on device;
                the HF Trainer's clipping returns it); None: computed here.
            clip_max: the max norm the framework clips the gradients to right after this call.
                The value taken now is then kept for the step (the optimizer's pre-hook would
                see clipped gradients) and the step record's ``clipped`` says whether clipping
                changed them.
        """
        if not self.enabled:
            return
        try:
            self._rec.grads_ready(norm, clip_max)
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
        self._rec.number_from(step)
        self._initial_snapshot()  # numbered again

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
            self._rec.record(loss, batch)
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)
            self._remove_hooks()

    def capture_now(self, trigger: str = MANUAL, message: str = "") -> None:
        """Write the ring buffer as a capture ending at the newest step (e.g. before a risky change)."""
        rec = self._rec
        if not self.enabled or not rec.ring.entries:
            return
        rec.flush_incident()
        rec.capture(trigger, rec.ring.entries[-1].step, message)

    # -------------------------------------------------------------- lifetime
    def _disable(self, exc: BaseException) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.latest.enabled = False
        log.error("sentineld: agent disabled after an internal error (training continues): %r", exc)
        try:
            self.stream.put(AgentNotice(AGENT_ERROR, repr(exc)).to_json(), urgent=True)
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
            self._rec.drop_probes()

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
        if self._live is not None:
            self._live.close_begins()  # a localization still running gets CLOSE_WAIT_S more
        self._remove_hooks()
        rec = self._rec
        if self.enabled:
            try:
                rec.readback.wait_all()
                rec.resolve_ready()
                rec.flush_incident()
                if rec.peers is not None:  # a peer's incident announced at its close is still captured
                    rec.peers.close()
                    rec.peer_captures()
                    rec.replica_captures()
            except Exception as exc:  # noqa: BLE001
                self._disable(exc)
        if rec.peers is not None:
            rec.peers.stop()
        deadline = time.monotonic() + timeout_s
        # +2 s: past its deadline the child is killed and the "failed" verdict written
        self._writer.join(deadline, localize_s=localize_live.CLOSE_WAIT_S + 2.0)
        rec.close_disk(remove=reason == "finished" or self._writer.crash_captured,
                       timeout_s=max(0.0, deadline - time.monotonic()))
        self.stream.put(EndLine(reason, rec.n, rec.wall()).to_json())
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
