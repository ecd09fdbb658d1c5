"""The counterfactual engine: re-run a captured step (and the captured steps after it) on a fresh
copy of the rebuilt state, with one declared change.

Three questions are the same operation (``docs/DESIGN.md``, "One counterfactual engine"): why a
loss spiked (this step's batch on an earlier state, another batch on this state:
:mod:`replay.spike`), whether a candidate fix holds (eps at the culprit op, lr x0.1, the culprit
module in fp32, the bad samples dropped: :mod:`replay.whatif`), and what class the fault is (the
step again, in float64: :mod:`replay.reproducibility`). Each is a :class:`Change`, a frozen
record of what differs from the run; :meth:`Engine.run` applies it and reports per-step losses
and finiteness as an :class:`Outcome`.

The state before any captured step is rebuilt once from the capture's snapshot by re-executing the
recorded steps (``replay.rebuild.run_step``: recorded batches, RNG restored at the first forward),
kept as a device copy, and loaded into a fresh recipe for every run, so runs never see each
other's changes. A change that makes the user's code raise (a dropped sample that breaks a shape)
gives an outcome with ``error`` set, not an exception.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from sentineld.contracts.capture import Capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.snapshot import state_of
from sentineld.contracts.treecodec import map_tensors

from .opguard import OpGuard, fp32_module, op_guard
from .rebuild import Rebuilt, load_snapshot, run_step, state_nonfinite

__all__ = ["Change", "Outcome", "Engine", "drop_samples", "batch_size"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class Change:
    """One declared difference from the recorded run (all fields default to "as recorded").

    Attributes:
        label: what the change is, in words (the ``change`` of a what-if row).
        batch_from: run the first step on this step's recorded batch instead of its own.
        state_before: start from the state before this step instead of before the first step run.
        drop_samples: indices (dim 0) removed from the first step's batch.
        lr_scale: every param group's lr multiplied by this for each optimizer step.
        clip_norm: gradient clipping at this global L2 norm (the smaller one if the run clips).
        optimizer_eps: each param group's ``eps`` raised to at least this.
        fp32_module: this module (``named_modules()`` name) runs in float32, autocast off.
        guard: eps / clamp / rewrite at one op (:class:`replay.opguard.OpGuard`).
        dtype: ``"float64"`` or ``"float32"``: model, optimizer state and batch in that dtype,
            autocast and GradScaler off.
    """

    label: str = "as recorded"
    batch_from: int | None = None
    state_before: int | None = None
    drop_samples: tuple[int, ...] = ()
    lr_scale: float | None = None
    clip_norm: float | None = None
    optimizer_eps: float | None = None
    fp32_module: str | None = None
    guard: OpGuard | None = None
    dtype: str | None = None


@dataclass
class Outcome:
    """What one run of a :class:`Change` gave.

    Attributes:
        losses: step -> loss (the step's forward on the state before it; NaN/Inf kept).
        grad_norms: step -> global grad norm before the optimizer step (after clipping if any).
        finite: every checked step left a finite loss and a finite state.
        steps_checked: steps run (stops after the first non-finite one).
        first_nonfinite: the first step whose loss or resulting state was non-finite, or None.
        error: the user code's exception under this change (``Type: message``), or None.
        guard_applied: call sites the op guard changed (None without a guard; 0: the change was
            no change).
        guard_calls: calls of the guarded op where the guard looked, changed or not (None
            without a guard; 0: the op never ran there; > ``guard_applied``: it ran, but the
            guard could not change it, e.g. a ``log`` whose input no rewritable op made).
        guard_rewrites: what the applied rewrites became (``log_softmax``, ...), once each.
        wall_s: seconds.
    """

    change: Change
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    finite: bool = True
    steps_checked: int = 0
    first_nonfinite: int | None = None
    error: str | None = None
    guard_applied: int | None = None
    guard_calls: int | None = None
    guard_rewrites: tuple[str, ...] = ()
    wall_s: float = 0.0

    @property
    def last_loss(self) -> float | None:
        """Loss of the last checked step, or None when no step ran."""
        return self.losses[max(self.losses)] if self.losses else None


def batch_size(batch: Any) -> int | None:
    """The batch dimension: dim 0 of the batch's first tensor with at least one dimension."""
    found: list[int] = []

    def look(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1:
            found.append(int(t.shape[0]))
        return t
    map_tensors(batch, look)
    return found[0] if found else None


def drop_samples(batch: Any, drop: tuple[int, ...]) -> Any:
    """``batch`` without rows ``drop`` (dim 0) of every tensor whose dim 0 is the batch size."""
    n = batch_size(batch)
    if n is None or not drop:
        return batch
    keep = torch.tensor([i for i in range(n) if i not in set(drop)], dtype=torch.long)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, keep.to(t.device)) if t.dim() >= 1 and t.shape[0] == n else t
    return map_tensors(batch, cut)


def _clone(state: Any) -> Any:
    return map_tensors(state, lambda t: t.detach().clone())


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _grad_norm(recipe: Recipe) -> float:
    grads = [p.grad.detach().float() for p in recipe.model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


class Engine:
    """Runs :class:`Change` s on fresh copies of a capture's rebuilt state.

    Use inside the run's environment (``replay.rebuild.torch_globals``) and with the capture open.

    Args:
        cap: the open capture.
        make: builds a fresh :class:`Recipe` (uninitialised until a state is loaded).

    Attributes:
        rebuilt: the re-executed steps' losses against the recorded ones (bit for bit).
        recorded: step -> recorded loss (the capture's records).
        records: step -> the capture's record of the step.
    """

    def __init__(self, cap: Capture, make: Callable[[], Recipe]) -> None:
        self.cap, self.make = cap, make
        self.steps = cap.steps
        self.snapshot_step = cap.snapshot_step
        self.records = {int(r["step"]): r for r in cap.records() if isinstance(r, dict) and "step" in r}
        self.recorded = {s: float(r["loss"]) for s, r in self.records.items()
                         if isinstance(r.get("loss"), (int, float))}
        self.rebuilt = Rebuilt()
        self._states: dict[int, Any] = {}
        self._loaded: dict[int, tuple[Any, Any]] = {}
        self._template: Recipe | None = None

    def load(self, step: int) -> tuple[Any, Any]:
        """``(batch, rng state)`` of a captured step (cached)."""
        if step not in self._loaded:
            st = self.cap.step(step)
            self._loaded[step] = (st.batch, st.rng)
        return self._loaded[step]

    def recipe_info(self) -> Recipe:
        """A recipe holding the snapshot (for what the run looked like: dtypes, autocast, clipping)."""
        if self._template is None:
            self._template = self.fresh(self.snapshot_step)
        return self._template

    def state_before(self, step: int) -> Any:
        """The state (model, optimizer, scheduler, scaler, carried grads) before ``step``, rebuilt
        from the nearest earlier one and cached.

        Raises:
            ValueError: ``step`` precedes the snapshot or is past the captured steps.
        """
        if step < self.snapshot_step or step > self.steps[-1] + 1:
            raise ValueError(f"no state before step {step}: the capture holds the snapshot at "
                             f"{self.snapshot_step} and steps {self.steps[0]}..{self.steps[-1]}")
        if step in self._states:
            return self._states[step]
        start = max((s for s in self._states if s <= step), default=None)
        rec = self.make()
        if start is None:
            load_snapshot(rec, self.cap.snapshot())
            start = self.snapshot_step
            self._states[start] = self._take(rec)
        else:
            load_snapshot(rec, _clone(self._states[start]))
        for s in range(start, step):
            batch, rng = self.load(s)
            loss = run_step(rec, batch, rng)
            self.rebuilt.compare(s, loss, self.recorded.get(s))
            self._states[s + 1] = self._take(rec)
        return self._states[step]

    def _take(self, rec: Recipe) -> Any:
        grads = None if rec.zero_grad else {n: p.grad for n, p in rec.model.named_parameters()
                                             if p.grad is not None}
        return _clone(state_of(rec.model, rec.optimizer, rec.scheduler, rec.scaler, grads))

    def fresh(self, step: int) -> Recipe:
        """A new recipe loaded with (a copy of) the state before ``step``."""
        rec = self.make()
        load_snapshot(rec, _clone(self.state_before(step)))
        return rec

    def run(self, change: Change, start: int, follow: int = 0,
            on_optimizer: Callable[[int, Recipe], None] | None = None) -> Outcome:
        """Run ``start`` and up to ``follow`` captured steps after it under ``change``.

        Args:
            start: the first step run (its recorded RNG; its batch unless ``change.batch_from``).
            follow: how many of the captured steps after ``start`` to run too.
            on_optimizer: called as ``(step, recipe)`` just before each optimizer step (the
                gradients are complete), e.g. to read per-module gradient norms.

        Returns:
            The :class:`Outcome`; stops after the first non-finite step.
        """
        t0 = time.perf_counter()
        out = Outcome(change)
        todo = [s for s in self.steps if start <= s][:follow + 1]
        try:
            rec = self.fresh(change.state_before if change.state_before is not None else start)
            _apply_static(rec, change)
            with _dynamic(rec, change, on_optimizer, todo) as current:
                for s in todo:
                    current["step"] = s
                    batch, _ = self.load(change.batch_from if s == start and change.batch_from is not None else s)
                    _, rng = self.load(s)
                    if s == start and change.drop_samples:
                        batch = drop_samples(batch, change.drop_samples)
                    if change.dtype:
                        batch = _cast_floats(batch, _DTYPES[change.dtype])
                    loss = run_step(rec, batch, rng)
                    out.losses[s] = loss
                    out.grad_norms[s] = _grad_norm(rec)
                    out.steps_checked += 1
                    if not math.isfinite(loss) or state_nonfinite(rec):
                        out.finite, out.first_nonfinite = False, s
                        break
                guard = current.get("guard")
                if guard is not None:
                    out.guard_applied, out.guard_calls = int(guard.applied), int(guard.calls)
                    out.guard_rewrites = tuple(dict.fromkeys(guard.rewrites))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code under a change
            out.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            out.finite = False
        out.wall_s = round(time.perf_counter() - t0, 4)
        return out


def _apply_static(rec: Recipe, change: Change) -> None:
    """Changes made once, before the first step: dtype, optimizer eps, clipping."""
    if change.dtype:
        dtype = _DTYPES[change.dtype]
        for t in [*rec.model.parameters(), *rec.model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(dtype)
        for st in rec.optimizer.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                    st[k] = v.to(dtype)
        for p in rec.model.parameters():
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
        rec.autocast_dtype = None
        rec.scaler = None
    if change.optimizer_eps is not None:
        for g in rec.optimizer.param_groups:
            if isinstance(g.get("eps"), float):
                g["eps"] = max(g["eps"], change.optimizer_eps)
    if change.clip_norm is not None:
        rec.clip_grad_norm = min(rec.clip_grad_norm or math.inf, change.clip_norm)


@contextlib.contextmanager
def _dynamic(rec: Recipe, change: Change, on_optimizer: Callable[[int, Recipe], None] | None,
             todo: list[int]) -> Iterator[dict[str, Any]]:
    """Changes active while the steps run: lr scaling around each optimizer step, the fp32
    module, the op guard, and the caller's optimizer probe. Yields a dict where the caller keeps
    the current ``step`` (and ``guard``: the active op guard)."""
    current: dict[str, Any] = {"step": todo[0] if todo else 0}
    saved: list[Any] = []
    hooks = []

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        if on_optimizer is not None:
            on_optimizer(current["step"], rec)
        if change.lr_scale is not None:
            saved[:] = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                if isinstance(g["lr"], float):
                    g["lr"] = g["lr"] * change.lr_scale

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        if change.lr_scale is not None and saved:
            for g, lr in zip(opt.param_groups, saved):
                g["lr"] = lr  # the scheduler steps from the run's own lr

    hooks.append(rec.optimizer.register_step_pre_hook(pre))
    hooks.append(rec.optimizer.register_step_post_hook(post))
    try:
        with contextlib.ExitStack() as stack:
            if change.fp32_module is not None:
                stack.enter_context(fp32_module(rec.model, change.fp32_module))
            if change.guard is not None:
                current["guard"] = stack.enter_context(op_guard(rec.model, change.guard))
            yield current
    finally:
        for h in hooks:
            h.remove()
