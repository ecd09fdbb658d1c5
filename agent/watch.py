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

The agent never raises into the loop: an internal error is logged once and the agent disables
itself (``watch.enabled`` becomes False), leaving model and optimizer as they were.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from sentineld.contracts.capture import CaptureStep, capture_name, write_capture
from sentineld.daemon.ring_recovery import DiskRingWriter
from sentineld.contracts.records import StepRecord, record_to_json
from sentineld.contracts.rng import capture_rng
from sentineld.contracts.rundir import (RunMeta, make_private_dir, stream_path, valid_run_id,
                              write_run_meta)
from sentineld.contracts.stream import StreamWriter

from .config import AgentConfig, default_runs_dir
from .exporter import Latest, start_exporter
from .exits import EXITS
from .ring import Ring, RingEntry, Snapshot, to_host, tree_nbytes
from .runinfo import default_run_id, dist_rank, torch_flags, unused_run_id, unwrap

__all__ = ["Watch", "attach"]

log = logging.getLogger("sentineld.agent")


class _Pending:
    """A step whose device values are in flight to the host."""

    __slots__ = ("step", "values", "event", "fields", "entry")

    def __init__(self, step: int, values: list[torch.Tensor | None], event: Any,
                 fields: dict[str, Any], entry: RingEntry) -> None:
        self.step, self.values, self.event, self.fields, self.entry = step, values, event, fields, entry

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


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
        config: AgentConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        run_id = run_id or default_run_id()
        if not valid_run_id(run_id):
            raise ValueError(f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if recipe is not None and ":" not in recipe:
            raise ValueError(f"recipe must be 'module:function', got {recipe!r}")
        self.config = config or AgentConfig()
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        # DDP/FSDP-style wrappers hold the real model in .module: snapshots and parameter names
        # use it, so the replay's plain model loads them without a "module." prefix.
        self._inner = unwrap(model)
        self.rank, world, local_rank = dist_rank()
        self._clock, self._wall = clock, wall_clock
        self._accumulating = accumulation_steps > 1
        self.enabled = True
        self.captures: list[Path] = []
        self.snapshot_every = self.config.snapshot_every or self.config.min_snapshot_every
        self._auto_k = self.config.snapshot_every == 0

        try:
            json.dumps(dict(recipe_args or {}), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"recipe_args must be JSON values (str, numbers, bools, lists, dicts): {exc}") from None
        parent = Path(runs_dir or default_runs_dir())
        try:
            run_id = unused_run_id(parent, run_id, self.rank)
            self.run_dir = make_private_dir(parent / run_id)
            write_run_meta(self.run_dir, RunMeta(
                run_id=run_id, recipe=recipe, recipe_args=dict(recipe_args or {}), rank=self.rank,
                world_size=world, torch_version=str(torch.__version__), num_threads=torch.get_num_threads(),
                num_classes=num_classes, started_s=wall_clock(), extra={"torch_flags": torch_flags()}))
            self.stream = StreamWriter(stream_path(self.run_dir, self.rank), self.config.flush_s)
        except OSError as exc:
            # Monitoring must not stop the training it watches: run on, switched off.
            log.error("sentineld: cannot write run directory %s (%s); the agent is off, training "
                      "continues. Pass runs_dir= or set SENTINELD_RUNS_DIR to a writable directory",
                      parent / run_id, exc)
            self.enabled = False
            self.run_dir = parent / run_id
            self.stream = StreamWriter(os.devnull, self.config.flush_s)
        self.run_id = run_id
        self.stream.put({"kind": "start", "run_id": run_id, "rank": self.rank, "pid": os.getpid(),
                         "host": socket.gethostname(), "time_s": wall_clock()}, urgent=True)
        self.latest = Latest()
        self._server = None
        self.metrics_port: int | None = None
        if self.config.metrics_port != 0 and self.enabled:
            port = self.config.metrics_port + (local_rank if self.config.metrics_port > 0 else 0)
            try:
                self._server, self.metrics_port = start_exporter(
                    self.latest, run_id, self.rank, port, self.config.metrics_addr)
            except OSError as exc:
                log.warning("sentineld: metrics export off: %s", exc)

        self._ring = Ring(self.config.window, self.config.ring_bytes)
        self._closed = False
        self._crash_captured = False
        # Imported now, not at the first capture: the exit paths (atexit, excepthook) write
        # captures, and a first `import h5py` from an atexit handler segfaults (h5py 3.16).
        import h5py  # noqa: F401, PLC0415
        for stale in self.run_dir.glob(f"capture-rank{self.rank}-*.h5.tmp"):
            stale.unlink(missing_ok=True)  # a capture a killed process of this rank never finished
        self._disk: DiskRingWriter | None = None
        if self.config.disk_ring:
            try:
                self._disk = DiskRingWriter(
                    self.run_dir, self.rank, self.config.window,
                    meta={"run_id": run_id, "torch_version": str(torch.__version__)},
                    on_warning=lambda text: self.stream.put(
                        {"kind": "agent_warning", "message": text}, urgent=True))
            except OSError as exc:
                log.warning("sentineld: on-disk ring off: %s", exc)
        self._n = 0
        self._t_last = clock()
        self._step_times: deque[float] = deque(maxlen=20)
        self._snap_s = 0.0
        self._snapshot_due = True
        self._since_snapshot = 0
        self._step_started = False
        self._rng: dict[str, Any] | None = None
        self._grads_carried: bool | None = None
        self._probe_checked = False
        self._gnorm: torch.Tensor | None = None
        self._pre_hook_ran = False
        self._pending: deque[_Pending] = deque()
        self._latched = False
        self._incident: tuple[str, int, Any, str] | None = None
        self._finite_streak = 0
        self._capture_threads: list[threading.Thread] = []
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._probe_param = min((p for p in model.parameters() if p.requires_grad and id(p) in opt_params),
                                key=lambda p: p.numel(), default=None)
        self._hooks = [
            model.register_forward_pre_hook(self._on_forward),
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
        EXITS.register(self)

    # ----------------------------------------------------------------- hooks
    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.enabled or self._step_started or not (module.training and torch.is_grad_enabled()):
            return
        try:
            self._step_started = True
            if self._snapshot_due:
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
        if not self.enabled:
            return
        try:
            self._gnorm = self._grad_norm()
            self._pre_hook_ran = True
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def _grad_norm(self) -> torch.Tensor | None:
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and not g.is_sparse:
                    by_device.setdefault((g.device, g.dtype), []).append(g)
        if not by_device:
            return None
        norms = []
        for grads in by_device.values():
            # float32 accumulation: a float16 grad norm overflows (65504) long before any element.
            low = grads[0].dtype in (torch.float16, torch.bfloat16)
            norms.extend(n.float() for n in (torch._foreach_norm(grads, 2, dtype=torch.float32) if low
                                             else torch._foreach_norm(grads)))
        dev = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev, non_blocking=True) for n in norms]))

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
        self._step_times.append(step_s)
        gnorm = self._gnorm if self._pre_hook_ran else self._grad_norm()
        skipped = not self._pre_hook_ran
        forward_seen = self._step_started
        self._gnorm, self._pre_hook_ran, self._step_started = None, False, False
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        values: list[torch.Tensor | None] = [loss_t.float().reshape(()), gnorm,
                                             lr if isinstance(lr, torch.Tensor) else None, scale]
        host_batch = to_host(batch)
        entry = RingEntry(step=n, batch=host_batch, rng=self._rng, record=None,
                          nbytes=tree_nbytes(host_batch))
        self._rng = None
        self._ring.add_step(entry)
        layers = self._probes.collect() if self._probes is not None else None
        if layers:
            self.latest.layers = dict(layers)
        fields = {"step": n, "step_s": step_s, "time_s": self._wall(), "optimizer_skipped": skipped,
                  "layers": layers or None,
                  "rank": self.rank, "grads_carried": self._grads_carried,
                  "lr": float(lr) if lr is not None and not isinstance(lr, torch.Tensor) else None}
        event = None
        if any(v is not None and v.device.type != "cpu" for v in values):
            values = [None if v is None else _pinned(v) for v in values]
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(n, values, event, fields, entry))
        self._n += 1
        self._since_snapshot += 1
        self._resolve_ready()
        if self._disk is not None:
            self._disk.add_step(entry, event)
        if self._incident is not None and self._n - 1 >= self._incident[1] + self.config.post_steps:
            self._flush_incident()
        if self._n % 16 == 1:  # cadence drifts slowly; re-derive it now and then, not per step
            self._tune_snapshot_cadence()
        if not self._latched and self._since_snapshot >= self.snapshot_every:
            self._snapshot_due = True
        if not forward_seen:
            # A loop that never calls model(...) itself (Lightning's training_step, a method of
            # the model): the end of this step is the start of the next one.
            if self._snapshot_due:
                self._take_snapshot(self._n)
            self._rng = capture_rng()

    def _resolve_ready(self) -> None:
        while self._pending and self._pending[0].ready():
            p = self._pending.popleft()
            loss, gnorm, lr_t, scale = (None if v is None else float(v) for v in p.values)
            fields = dict(p.fields)
            if lr_t is not None:
                fields["lr"] = lr_t
            record = StepRecord(loss=float("nan") if loss is None else loss, grad_norm=gnorm,
                                loss_scale=scale, **fields)
            self._emit(record, p.entry, same_step=(p.step == self._n - 1))

    def _emit(self, record: StepRecord, entry: RingEntry, same_step: bool) -> None:
        obj = record_to_json(record)
        entry.record = obj
        lt = self.latest
        lt.record = record
        lt.steps_total += 1
        lt.skipped_total += int(record.optimizer_skipped)
        # GradScaler's skipped steps carry inf gradients by design; a non-finite loss never is.
        bad = (not math.isfinite(record.loss) or (record.nonfinite and not record.optimizer_skipped)
               or (record.lr is not None and not math.isfinite(record.lr)))
        lt.nonfinite_total += int(bad)
        self.stream.put(obj, urgent=bad)
        if bad:
            self._finite_streak = 0
            if not self._latched:
                self._latched = True
                grads = self._grads_now() if same_step else None
                self._incident = ("nonfinite", record.step, grads,
                                  f"loss={record.loss} grad_norm={record.grad_norm} lr={record.lr} "
                                  f"at step {record.step}")
        else:
            self._finite_streak += 1
            if self._latched and self._finite_streak >= self.config.rearm_steps:
                self._latched = False

    def _grads_now(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self._inner.named_parameters()}
        return {names.get(id(p), f"param{i}"): p.grad.detach().to("cpu", copy=True)
                for i, p in enumerate(q for g in self.optimizer.param_groups for q in g["params"])
                if p.grad is not None}

    # ------------------------------------------------------------- snapshots
    def _take_snapshot(self, step: int) -> None:
        t0 = self._clock()
        state = {
            "model": self._inner.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        # Gradients are part of the state only in a loop that does not zero them before the
        # forward (no zero_grad, or accumulation across steps): then the next step adds to them.
        grads = {n: p.grad for n, p in self._inner.named_parameters() if p.grad is not None}
        if grads:
            state["grads"] = grads
        host = to_host(state)
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        snap = Snapshot(step=step, state=host, event=event, nbytes=tree_nbytes(host))
        self._ring.add_snapshot(snap)
        if self._disk is not None:
            self._disk.add_snapshot(snap)
        self._snap_s = max(self._snap_s * 0.5, self._clock() - t0)
        self._snapshot_due = False
        self._since_snapshot = 0

    def _tune_snapshot_cadence(self) -> None:
        k = self.snapshot_every
        if self._auto_k and len(self._step_times) >= 5:
            step_s = sorted(self._step_times)[len(self._step_times) // 2]
            if step_s > 0:
                k = math.ceil(self._snap_s / (self.config.snapshot_budget * step_s))
                k = max(self.config.min_snapshot_every, min(k, self.config.window // 2))
        # The ring must hold a whole span (snapshot .. offending step + post_steps) or the capture
        # is lost: with large batches that bound beats the time budget.
        last = self._ring.entries[-1].nbytes if self._ring.entries else 0
        if last > 0:
            fits = self.config.ring_bytes // last
            k = max(1, min(k, (fits - self.config.post_steps) // 2))
        self.snapshot_every = k

    # -------------------------------------------------------------- captures
    def _flush_incident(self) -> None:
        if self._incident is None:
            return
        trigger, step, grads, message = self._incident
        self._incident = None
        last = self._ring.entries[-1].step if self._ring.entries else step
        self._capture(trigger, step, grads, message, last=max(step, last))

    def _capture(self, trigger: str, step: int, grads: dict[str, torch.Tensor] | None,
                 message: str, last: int | None = None) -> None:
        span = self._ring.span(step if last is None else last, before=step)
        if span is None:
            log.warning("sentineld: step %d is not in the ring buffer (window %d); no capture",
                        step, self.config.window)
            self.stream.put({"kind": "agent_warning", "step": step,
                             "message": "no clean snapshot in the ring; capture skipped"}, urgent=True)
            return
        snap, entries = span
        path = self.run_dir / capture_name(self.rank, step, trigger)
        args = (path, trigger, step, snap, entries, grads, message)
        t = threading.Thread(target=self._write_capture, args=args, name="sentineld-capture", daemon=True)
        self._capture_threads.append(t)
        t.start()

    def _write_capture(self, path: Path, trigger: str, step: int, snap: Snapshot,
                       entries: list[RingEntry], grads: Any, message: str) -> None:
        try:
            snap.wait()
            if self._device.type == "cuda":
                torch.cuda.synchronize()  # blocks this thread only: batch copies must have landed
            write_capture(
                path, run_id=self.run_id, rank=self.rank, trigger=trigger, first_step=step,
                snapshot_step=snap.step, snapshot=snap.state,
                steps=[CaptureStep(e.step, e.batch, e.rng) for e in entries],
                records=[e.record for e in entries if e.record is not None], grads=grads,
                message=message)
        except Exception as exc:  # noqa: BLE001 - disk full etc.: training goes on
            log.warning("sentineld: capture %s not written: %s (training continues)", path.name, exc)
            self.stream.put({"kind": "agent_warning", "step": step,
                             "message": f"capture not written: {exc}"}, urgent=True)
            return
        self.captures.append(path)
        self._crash_captured |= trigger == "crash"
        self.latest.captures_total += 1
        self.stream.put({"kind": "capture", "step": step, "trigger": trigger, "path": path.name,
                         "snapshot_step": snap.step}, urgent=True)

    def capture_now(self, trigger: str = "manual", message: str = "") -> None:
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
        if getattr(self, "_probes", None) is not None:
            self._probes.remove()
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
                for p in self._pending:
                    if p.event is not None:
                        p.event.synchronize()
                self._resolve_ready()
                self._flush_incident()
            except Exception as exc:  # noqa: BLE001
                self._disable(exc)
        deadline = time.monotonic() + timeout_s
        for t in self._capture_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._disk is not None:
            self._disk.close(remove=reason == "finished" or self._crash_captured,
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
                self.capture_now("crash", message)
            except Exception as err:  # noqa: BLE001
                log.warning("sentineld: crash capture failed: %r", err)
        self.close(reason, timeout_s=timeout_s)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    return out




def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Watch:
    """Attach the agent to ``model`` and ``optimizer``; returns the :class:`Watch`.

    Keyword Args:
        run_id: name of the run (default ``$SENTINELD_RUN_ID``, ``$TORCHELASTIC_RUN_ID``, or
            time-host-pid). All ranks of one job must share it.
        runs_dir: parent of run directories (default ``$SENTINELD_RUNS_DIR`` or the user state dir).
        recipe: ``"module:function"`` returning a :class:`sentineld.contracts.recipe.Recipe`; lets the
            replay rebuild model and loss from the run's working directory.
        recipe_args: JSON-ready keyword arguments for the recipe function (stored in run.json).
        scheduler, scaler: the LR scheduler and GradScaler, so snapshots include their state.
        num_classes: C of a C-class loss (enables the ln(C) initial-loss check).
        accumulation_steps: micro-batches per optimizer step (>1 disables the carried-grads check).
        config: :class:`AgentConfig`, or pass its fields as keywords (e.g. ``metrics_port=0``).

    Raises:
        TypeError: model or optimizer of the wrong type.
        ValueError: a bad run id, recipe or config value (the message names it).
    """
    cfg_fields = set(AgentConfig.__dataclass_fields__)
    own = set(inspect.signature(Watch.__init__).parameters) - {"self", "model", "optimizer"}
    unknown = sorted(set(kwargs) - cfg_fields - own)
    if unknown:
        raise ValueError(f"unknown agent setting(s) {unknown}; known: {sorted(own | cfg_fields)}")
    cfg_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in cfg_fields}
    if cfg_kwargs:
        if kwargs.get("config") is not None:
            raise ValueError("pass either config= or config fields as keywords, not both")
        kwargs["config"] = AgentConfig.from_mapping(cfg_kwargs)
    return Watch(model, optimizer, **kwargs)
