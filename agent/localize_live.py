"""The training process localizes its own incidents: ``attach(model, optimizer, loss_fn=...)``.

Where it runs: in the capture's background thread, right after the capture was written. Training
goes on meanwhile (torch ops release the GIL); at a normal end, an uncaught exception, SIGTERM or
interpreter exit, ``Watch.close`` waits for it (up to its ``timeout_s``), so a run about to die
still leaves its verdict. The verdict is written next to the capture
(:func:`sentineld.contracts.verdict_file.verdict_path`), where the daemon picks it up and delivers it instead of
spawning a replay of its own.

What it runs:

- with ``loss_fn``: the replay engine (:func:`replay.engine.replay_capture`) on the capture just
  written, with recipes built from copies of the live objects (:class:`replay.inmemory.LiveSpec`):
  steps S..N-1 re-executed from the snapshot and compared bit for bit, step N traced.
- with neither ``loss_fn`` nor a recipe: the model's recorded top-level forward calls are traced
  on the snapshot's parameters (:mod:`replay.forward_only`); the verdict says what it could not
  check.

It never disturbs training: recorded RNG states go into private generators of its own thread
(:mod:`replay.private_rng`), global module hooks of the tracer ignore other threads, the live
model, optimizer and their tensors are only read, and process-wide flags are not touched (training
with and without it is bitwise identical). It does share the CPU and the GIL with training while
it runs: on two busy cores a 1 M-parameter model's steps took ~30% longer for the ~0.3-1.4 s it ran
(``bench/in_process_localize.py``).

Memory: a second copy of the model (parameters and buffers) and of the optimizer state, on the
model's device, while it runs (the estimate is logged at attach, kept in ``memory_bytes`` and
in run.json as ``localize_memory_bytes``); with forward-only, a host copy of each ring step's forward arguments all the
time. ``localize="off"`` switches it off (for models too large for a second copy; the daemon's
replay with a recipe still works).

Imports: the replay's code (``sentineld.replay.*``) is imported inside the capture thread, at the
first localization, never by ``import sentineld.agent`` or ``attach`` (docs/DESIGN.md, "Who imports
what"); the agent's own part (this module) needs only torch and the contracts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from sentineld.contracts.verdict import Replayed, make_report
from sentineld.contracts.verdict_file import LOCALIZE_MODES, LOCALIZED_TRIGGERS, write_verdict

from .ring import HostCopies, RingEntry, Snapshot

__all__ = ["LiveLocalizer", "make_localizer", "state_bytes", "CLOSE_WAIT_S", "CHILD_TIMEOUT_S"]

log = logging.getLogger("sentineld.agent")

#: Most seconds ``Watch.close`` waits for a localization still running when the run ends (the
#: capture itself is always waited for): then the child is killed (or the thread left behind),
#: a ``failed`` verdict says so and the daemon replays the run itself.
CLOSE_WAIT_S = 30.0
#: Most seconds a child localization may run while training goes on (then it is killed).
CHILD_TIMEOUT_S = 600.0

#: The child's import path is the training process's own (handed over in this variable), not
#: ``python -m``'s, which puts the working directory first: training run as ``cd /tmp && python
#: ~/proj/train.py`` never imports from /tmp, but its child did (another user's
#: ``/tmp/sentineld/__init__.py`` ran as the training user).
CHILD_PATH_ENV = "SENTINELD_LIVE_CHILD_PATH"
_CHILD_BOOT = ("import sys\n"
               "if sys.path and sys.path[0] == '':\n"
               "    del sys.path[0]  # -c's working directory: gone before anything is imported\n"
               "import json, os, runpy\n"
               "sys.path[:] = json.loads(os.environ.pop(%r))\n"
               "runpy.run_module('sentineld.replay.live_child', run_name='__main__', alter_sys=True)\n"
               % CHILD_PATH_ENV)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the model's parameters and buffers (a tied tensor once) plus the optimizer's
    tensor state: what a second copy of them takes."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        # A lazy module's parameters have no size until its first forward: they count 0 here.
        if id(t) not in seen and not torch.nn.parameter.is_lazy(t):
            seen.add(id(t))
            total += t.numel() * t.element_size()
    if optimizer is not None:
        for st in list(optimizer.state.values()):
            for v in list(st.values()):
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
    return total


def _optimizer_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params_bytes: int) -> int:
    """Optimizer state bytes now, or (before the first step) a guess from its class."""
    have = state_bytes(torch.nn.Module(), optimizer)
    if have:
        return have
    name = type(optimizer).__name__.lower()
    per = 2 if "adam" in name else 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
    return per * params_bytes


class LiveLocalizer:
    """Records what the in-process localization needs, and runs it after a capture.

    Args:
        model: the live (unwrapped) module; optimizer: the live optimizer.
        loss_fn: ``(model, batch) -> scalar loss``, or None for forward-only.
        window: ring steps (bounds the recorded forward calls, with ``max_bytes`` in settings).
        run_id: the run's id (put into the verdict).
        settings: ``scheduler``, ``scaler``, ``accumulation_steps``, ``clip_grad_norm``,
            ``num_classes`` as given to ``attach``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None, window: int, run_id: str,
                 mode: str = "thread", **settings: Any) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        #: ``process`` (a child process replays from the recorded live recipe), ``thread``, or
        #: ``auto`` until :meth:`recorded` resolved it.
        self.mode = mode
        #: The recorded live recipe (run.json ``extra.live_recipe``), or None.
        self.live_args: dict[str, Any] | None = None
        #: Set by ``Watch.close``: a running localization gets :data:`CLOSE_WAIT_S` more seconds.
        self.closing = threading.Event()
        self._closing_at: float | None = None
        self.run_id = run_id
        self.settings = settings
        self.forward_only = loss_fn is None
        self.calls: deque[tuple[int, Any, Any]] = deque(maxlen=window + 4)
        self._call_bytes: deque[int] = deque(maxlen=window + 4)
        self.max_bytes = int(settings.pop("max_bytes", 1 << 62))
        #: True once an internal error switched the localizer off.
        self.off = False
        self._one_at_a_time = threading.Lock()
        self.modes: dict[int, list[bool]] = {}
        self.num_threads = torch.get_num_threads()
        self.autocast: torch.dtype | None = None
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")
        params = state_bytes(model)
        #: Estimated bytes of the second copy (model + optimizer state) made at an incident.
        self.memory_bytes = params + (0 if self.forward_only else _optimizer_estimate(model, optimizer, params))
        self.verdicts: list[Path] = []
        self.last_s: float | None = None
        #: The agent's per-step host copies (set by the Watch), shared with its batch copy.
        self.copies: HostCopies | None = None
        self._calls_nbytes = 0

    def recorded(self) -> dict[str, Any]:
        """run.json's ``extra`` fields that rebuild this run without a recipe; resolves ``auto``.

        ``live_recipe`` (with ``loss_fn``) or ``model_structure`` (forward-only), see
        :mod:`sentineld.contracts.structure`; ``localize_process_off`` says why a ``loss_fn`` run
        localizes in a thread (its live objects cannot be rebuilt in a child). Never raises.
        """
        from sentineld.contracts.structure import function_ref, module_tree, optimizer_tree, problems, scheduler_tree  # noqa: PLC0415
        try:
            tree = module_tree(self.model)
            if self.forward_only:
                self.mode = "thread" if self.mode == "auto" else self.mode
                return {"model_structure": tree}
            s = self.settings
            names = {id(p): n for n, p in self.model.named_parameters()}
            scaler = s.get("scaler")
            args: dict[str, Any] = {
                "model": tree, "optimizer": optimizer_tree(self.optimizer, names),
                "loss_fn": function_ref(self.loss_fn), "root": os.getcwd(),
                "clip_grad_norm": s.get("clip_grad_norm"),
                "accumulation_steps": int(s.get("accumulation_steps") or 1), "num_classes": s.get("num_classes"),
                "scheduler": scheduler_tree(s["scheduler"]) if s.get("scheduler") is not None else None,
                "scaler": ({"enabled": bool(scaler.is_enabled()), "device": str(getattr(scaler, "_device", "cuda"))}
                           if scaler is not None else None)}
            json.dumps(args, allow_nan=False)
            self.live_args = args
            why = problems(args)
            if self.mode == "auto":
                self.mode = "thread" if why else "process"
            return {"live_recipe": args, **({"localize_process_off": why} if why else {})}
        except Exception as exc:  # noqa: BLE001 - the agent never breaks training
            self.mode = "thread" if self.mode == "auto" else self.mode
            log.info("sentineld: the live model/optimizer/loss_fn cannot be recorded for a later replay: %r", exc)
            return {"live_recipe_error": f"{type(exc).__name__}: {exc}"[:500]}

    def close_begins(self) -> None:
        """``Watch.close`` started: a localization still running gets :data:`CLOSE_WAIT_S` more."""
        self._closing_at = time.monotonic()
        self.closing.set()

    # ------------------------------------------------------------ per step
    def on_forward(self, step: int, args: Any, kwargs: Any, snapshot_due: bool) -> None:
        """At the first training forward of ``step`` (the agent's forward pre-hook). Never raises:
        on an error the localizer switches itself off, the rest of the agent goes on."""
        if self.off:
            return
        try:
            self._on_forward(step, args, kwargs, snapshot_due)
        except Exception as exc:  # noqa: BLE001
            self.off = True
            log.error("sentineld: in-process localization off after an internal error (the agent and "
                      "training go on): %r", exc)

    def _on_forward(self, step: int, args: Any, kwargs: Any, snapshot_due: bool) -> None:
        dt = self._device_type
        self.autocast = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
        if snapshot_due:
            self.modes[step] = [m.training for m in self.model.modules()]
            for old in sorted(self.modes)[:-3]:
                del self.modes[old]
            self.num_threads = torch.get_num_threads()
        if self.forward_only:
            # Through the agent's per-step HostCopies when set: a forward argument that is also
            # in the batch is then copied to host once per step, not twice.
            copies = self.copies or HostCopies()
            (host_args, host_kwargs), nbytes = copies.copy((tuple(args), dict(kwargs or {})))
            self.calls.append((step, host_args, host_kwargs))
            self._call_bytes.append(nbytes)
            self._calls_nbytes = sum(self._call_bytes)
            while len(self.calls) > 1 and self._calls_nbytes > self.max_bytes:  # the ring's byte bound
                self.calls.popleft()
                self._call_bytes.popleft()
                self._calls_nbytes = sum(self._call_bytes)

    def calls_for(self, entries: list[RingEntry]) -> dict[int, Any] | None:
        """The recorded forward calls of ``entries``' steps, for the capture (forward-only runs)."""
        if not self.forward_only:
            return None
        steps = {e.step for e in entries}
        cast = str(self.autocast).removeprefix("torch.") if self.autocast is not None else None
        return {s: {"args": a, "kwargs": k, "autocast": cast} for s, a, k in list(self.calls) if s in steps}

    # ------------------------------------------------------------ at an incident
    def after_capture(self, path: Path, trigger: str, step: int, snap: Snapshot, entries: list[RingEntry]) -> None:
        """Localize the capture at ``path`` and write its verdict (runs in the capture thread).

        Never raises: a failure is written as the verdict ``{"result": "failed", "reason": ...}``
        (the daemon then replays with the run's recipe, or reports the reason).
        """
        if trigger not in LOCALIZED_TRIGGERS or self.off:
            return
        t0 = time.perf_counter()
        try:
            with self._one_at_a_time:  # at most one second copy at a time (incident + crash captures)
                if self.mode == "process" and self.live_args is not None:
                    text = self._in_child(path, snap)
                    if text is not None:
                        self.verdicts.append(write_verdict(path, text))
                        self.last_s = time.perf_counter() - t0
                        return
                replayed = self._forward_only(snap, entries, step) if self.forward_only else self._full(path, snap)
            wall_s = round(time.perf_counter() - t0, 4)
            report = make_report(replace(replayed, capture=str(path)), self.run_id, elapsed_s=wall_s, evidence={
                "in_process": {"mode": "thread", "memory_bytes": self.memory_bytes, "wall_s": wall_s}})
            self.verdicts.append(write_verdict(path, report.to_json()))
        except Exception as exc:  # noqa: BLE001 - training must go on; the daemon falls back
            log.warning("sentineld: in-process localization of %s failed: %r", path.name, exc)
            try:
                self.verdicts.append(write_verdict(path, {"result": "failed",
                                                          "reason": f"{type(exc).__name__}: {exc}"[:2000]}))
            except OSError as err:
                log.warning("sentineld: verdict for %s not written: %s", path.name, err)
        self.last_s = time.perf_counter() - t0

    def _deadline(self, started: float) -> float:
        end = started + CHILD_TIMEOUT_S
        if self._closing_at is not None:
            end = min(end, self._closing_at + CLOSE_WAIT_S)
        return end

    def _in_child(self, path: Path, snap: Snapshot) -> str | None:
        """The verdict JSON from a child process (:mod:`replay.live_child`), or None when the child
        could not rebuild the run (the thread then localizes). Raises TimeoutError past the
        deadline (the child is killed)."""
        from sentineld.contracts.capture import open_capture  # noqa: PLC0415

        with open_capture(path) as cap:
            carried = any(isinstance(r, dict) and r.get("grads_carried") for r in cap.records())
        args = dict(self.live_args or {})
        if self.autocast is not None:
            args["autocast_dtype"] = str(self.autocast).removeprefix("torch.")
        spec = {"run_dir": str(path.parent), "capture": str(path), "recipe_args": args,
                "zero_grad": not carried, "modes": self.modes.get(snap.step), "num_threads": self.num_threads}
        t0 = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, self.num_threads)), CHILD_PATH_ENV: json.dumps(sys.path)}
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_BOOT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd(), env=env,
                                start_new_session=True)
        payload: str | None = json.dumps(spec)
        out = err = b""
        while True:
            try:
                o, e = proc.communicate(payload.encode() if payload is not None else None, timeout=0.25)
                out, err = out + (o or b""), err + (e or b"")
                break
            except subprocess.TimeoutExpired:
                payload = None  # written already
                if time.monotonic() > self._deadline(t0):
                    proc.kill()
                    proc.communicate()
                    raise TimeoutError(f"the localization child ran past its deadline ({time.monotonic() - t0:.1f} s; "
                                       f"{CLOSE_WAIT_S:g} s after close, {CHILD_TIMEOUT_S:g} s while training) "
                                       "and was killed") from None
        try:
            verdict = json.loads(out.decode("utf-8", "replace"))
        except ValueError:
            verdict = {"result": "failed", "reason": f"the child exited {proc.returncode}: "
                                                     f"{err.decode('utf-8', 'replace')[-1500:]}"}
        if not isinstance(verdict, dict) or verdict.get("result") == "failed":
            log.warning("sentineld: localization in a child process failed (%s); localizing in a thread",
                        str(verdict.get("reason") if isinstance(verdict, dict) else verdict)[:500])
            return None
        ev = verdict.setdefault("evidence", {})
        ev["in_process"] = {"mode": "process", "memory_bytes": self.memory_bytes,
                            "wall_s": round(time.monotonic() - t0, 4)}
        verdict["run_id"], verdict["capture"] = self.run_id, str(path)
        return json.dumps(verdict, allow_nan=False)

    def _full(self, path: Path, snap: Snapshot) -> Replayed:
        from sentineld.contracts.capture import open_capture  # noqa: PLC0415
        from sentineld.replay.engine import replay_capture  # noqa: PLC0415
        from sentineld.replay.inmemory import LiveSpec  # noqa: PLC0415

        if self.loss_fn is None:  # a forward-only run localizes with _forward_only
            raise ValueError("a full in-process localization needs the run's loss_fn")
        with open_capture(path) as cap:
            carried = any(isinstance(r, dict) and r.get("grads_carried") for r in cap.records())
        s = self.settings
        spec = LiveSpec(self.model, self.optimizer, self.loss_fn, scheduler=s.get("scheduler"),
                        scaler=s.get("scaler"), accumulation_steps=int(s.get("accumulation_steps") or 1),
                        clip_grad_norm=s.get("clip_grad_norm"), num_classes=s.get("num_classes"),
                        zero_grad=not carried, autocast_dtype=self.autocast, modes=self.modes.get(snap.step))
        return replay_capture(path, lambda: spec.make, None, lambda: isolated(self.num_threads))

    def _forward_only(self, snap: Snapshot, entries: list[RingEntry], step: int) -> Replayed:
        from sentineld.replay.forward_only import ForwardCall, localize_forward  # noqa: PLC0415
        from sentineld.replay.inmemory import copy_module  # noqa: PLC0415

        snap.wait()
        model = copy_module(self.model, self.modes.get(snap.step))
        model.load_state_dict(snap.state["model"])
        rngs = {e.step: e.rng for e in entries}
        calls = [ForwardCall(s, a, k, dict(r) if (r := rngs.get(s)) else None)
                 for s, a, k in list(self.calls) if s in rngs]
        losses = {e.step: float(e.record["loss"]) for e in entries
                  if isinstance(e.record, dict) and isinstance(e.record.get("loss"), (int, float))}
        with isolated(self.num_threads) as flags:
            found = localize_forward(model, snap.step, calls, step, flags["_rng"].set_state,
                                     autocast_dtype=self.autocast, recorded_losses=losses)
        in_effect = {k: v for k, v in flags.items() if not k.startswith("_")}
        return replace(found, evidence={**found.evidence, "torch_flags": in_effect})


@contextlib.contextmanager
def isolated(num_threads: int) -> Iterator[dict[str, Any]]:
    """This thread runs with the run's thread count and private generators; yields the settings
    in effect (filled with ``unisolated_random_ops`` on exit)."""
    from sentineld.replay.private_rng import private_rng  # noqa: PLC0415
    from sentineld.replay.rebuild import current_flags  # noqa: PLC0415

    torch.set_num_threads(max(1, int(num_threads)))
    flags: dict[str, Any] = {}
    # On CUDA, a stream of its own: on training's stream its kernels would queue behind (and
    # before) training's, and its host reads would wait for them.
    side = (torch.cuda.stream(torch.cuda.Stream()) if torch.cuda.is_available() and torch.cuda.is_initialized()
            else contextlib.nullcontext())
    try:
        with side, private_rng() as mode:
            flags.update(current_flags(), in_process=True, _rng=mode)
            yield flags
    finally:
        # A fresh thread takes its count from the process-wide value this call set: put back
        # the run's (the training thread's own count is its own and was never changed).
        torch.set_num_threads(max(1, int(num_threads)))
        mode_ = flags.pop("_rng", None)
        flags["unisolated_random_ops"] = sorted(getattr(mode_, "unisolated", ()))


def make_localizer(mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Any, recipe: str | None, window: int, run_id: str,
                   **settings: Any) -> LiveLocalizer | None:
    """The localizer ``attach`` asked for, or None.

    ``mode`` is ``thread`` or ``off``; a run with a recipe and no ``loss_fn`` leaves the replay to
    the daemon (as before). Logs the memory a second copy will take.

    Raises:
        ValueError: ``mode`` is not one of :data:`sentineld.contracts.verdict_file.LOCALIZE_MODES`, or
            ``loss_fn`` is not callable.
    """
    if mode not in LOCALIZE_MODES:
        raise ValueError(f"localize must be one of {list(LOCALIZE_MODES)}, got {mode!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function (model, batch) -> loss, got {type(loss_fn).__name__}")
    if mode == "off" or (loss_fn is None and recipe is not None):
        return None
    loc = LiveLocalizer(model, optimizer, loss_fn, window, run_id, mode=mode, **settings)
    what = ("forward-only (no loss_fn, no recipe: loss, backward and optimizer are not checked; "
            "pass loss_fn= to check them)" if loc.forward_only else "full replay with loss_fn")
    log.info("sentineld: in-process localization on, %s; at an incident it builds a second copy of the "
             "model%s, about %.1f MiB; pass localize='off' if that does not fit",
             what, "" if loc.forward_only else " and optimizer", loc.memory_bytes / 2**20)
    return loc
