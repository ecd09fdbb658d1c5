"""Rebuild the training state at step N from snapshot S by re-executing steps S..N-1.

Each step is re-run with :func:`sentineld.contracts.recipe.train_step` on the recorded batch (all
micro-batches), with every RNG restored where the agent read it (the model's first training
forward of the step), so dropout and noise sampled inside the model draw the same numbers. The
recipe brings the optimizer, LR scheduler, GradScaler, clipping, accumulation and autocast; the
snapshot brings their state. The model keeps the snapshot's dtypes (a model built in float32 and
cast to bfloat16 by the training script is cast back before loading), and the process runs with
the run's thread count and any deterministic flags it recorded. Each rebuilt loss is compared with
the recorded one, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from sentineld.contracts.errors import BadInput
from sentineld.contracts.recipe import Recipe, train_step
from sentineld.contracts.rng import restore_rng
from sentineld.contracts.snapshot import MODEL, grads_of
from sentineld.contracts.treecodec import map_tensors

from .trace import is_finite, one_thread

__all__ = ["RebuildError", "Rebuilt", "load_snapshot", "run_step", "rebuild", "torch_globals",
           "same_loss", "state_nonfinite", "rng_restorer"]

# Per thread: the training process localizes in a thread of its own and restores recorded RNG
# states into private generators (replay.private_rng), never into the ones training draws from.
_local = threading.local()


@contextlib.contextmanager
def rng_restorer(restore: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """In this thread, restore a step's recorded RNG state with ``restore`` instead of
    :func:`sentineld.contracts.rng.restore_rng` (which sets the process-wide generators)."""
    saved = getattr(_local, "restore", None)
    _local.restore = restore
    try:
        yield
    finally:
        _local.restore = saved


class RebuildError(BadInput):
    """The recipe's model or optimizer does not match the captured state."""


@dataclass
class Rebuilt:
    """Outcome of re-executing steps.

    Attributes:
        losses: step -> rebuilt loss.
        max_deviation: largest |rebuilt - recorded| loss (inf when only one is finite).
        equal: every rebuilt loss equals the recorded one bit for bit (NaN equals NaN).
        broke: first step after which loss, parameters, optimizer state or LR were non-finite.
    """

    losses: dict[int, float] = field(default_factory=dict)
    max_deviation: float = 0.0
    equal: bool = True
    broke: int | None = None

    def compare(self, step: int, loss: float, recorded: float | None) -> None:
        """Record ``loss`` of ``step`` and compare it with ``recorded`` (None: not recorded)."""
        self.losses[step] = loss
        if recorded is None or same_loss(loss, recorded):
            return
        self.equal = False
        dev = abs(loss - recorded) if math.isfinite(loss) and math.isfinite(recorded) else math.inf
        self.max_deviation = max(self.max_deviation, dev)


def same_loss(a: float, b: float) -> bool:
    """Bitwise equality of two losses as Python floats, with NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def _to_device(tree: Any, device: torch.device) -> Any:
    return map_tensors(tree, lambda t: t.to(device))


def load_snapshot(recipe: Recipe, snapshot: dict[str, Any]) -> list[str]:
    """Load ``snapshot`` into ``recipe`` keeping the snapshot's dtypes; return what was recast.

    Raises:
        RebuildError: missing/unexpected keys, shape mismatch, or an optimizer that does not fit.
    """
    device = next((p.device for p in recipe.model.parameters()), torch.device("cpu"))
    snapshot = _to_device(snapshot, device)
    recast = []
    model_sd = snapshot.get(MODEL) or {}
    own = dict(recipe.model.named_parameters()) | dict(recipe.model.named_buffers())
    for name, t in model_sd.items():
        cur = own.get(name)
        if isinstance(t, torch.Tensor) and cur is not None and cur.is_floating_point() \
                and t.is_floating_point() and cur.dtype != t.dtype:
            cur.data = cur.data.to(t.dtype)  # same Parameter object: the optimizer still holds it
            recast.append(f"{name}: {str(cur.dtype).removeprefix('torch.')}")
    try:
        recipe.load_state(snapshot)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise RebuildError(f"the recipe's model/optimizer does not match the captured state: "
                           f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}") from None
    # Gradients carried into the step (a loop without zero_grad) are part of the state.
    grads = grads_of(snapshot)
    for name, p in recipe.model.named_parameters():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
    return recast


@contextlib.contextmanager
def torch_globals(num_threads: int, flags: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Run with the run's thread count and deterministic flags; restore everything after.

    Args:
        num_threads: torch intra-op threads the run used (CPU reductions depend on it).
        flags: optional ``{"deterministic_algorithms": bool, "cudnn_deterministic": bool,
            "cudnn_benchmark": bool, "float32_matmul_precision": str}`` as recorded by the run.

    Yields:
        The flags in effect (evidence).
    """
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.get_float32_matmul_precision(), torch.get_rng_state(), np.random.get_state(),
             random.getstate())
    flags = dict(flags or {})
    try:
        torch.set_num_threads(max(1, int(num_threads)))
        if "deterministic_algorithms" in flags:
            torch.use_deterministic_algorithms(bool(flags["deterministic_algorithms"]))
        if "cudnn_deterministic" in flags:
            torch.backends.cudnn.deterministic = bool(flags["cudnn_deterministic"])
        if "cudnn_benchmark" in flags:
            torch.backends.cudnn.benchmark = bool(flags["cudnn_benchmark"])
        if "float32_matmul_precision" in flags:
            torch.set_float32_matmul_precision(str(flags["float32_matmul_precision"]))
        yield current_flags()
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.set_float32_matmul_precision(saved[4])
        torch.set_rng_state(saved[5])
        np.random.set_state(saved[6])
        random.setstate(saved[7])


def current_flags() -> dict[str, Any]:
    """The process-wide settings a step's numerics depend on."""
    return {"num_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


@contextlib.contextmanager
def _rng_at_first_forward(model: torch.nn.Module, rng: Any) -> Iterator[None]:
    """Restore ``rng`` where the agent read it: the model's first training forward of the step."""
    if rng is None:
        yield
        return
    done = False

    def pre(module: torch.nn.Module, args: Any) -> None:
        nonlocal done
        if not done and module.training and torch.is_grad_enabled():
            done = True
            (getattr(_local, "restore", None) or restore_rng)(dict(rng))

    h = model.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        h.remove()


def run_step(recipe: Recipe, batch: Any, rng: Any, on_phase: Callable[[str], None] | None = None) -> float:
    """Run one step as the run did; return its loss as a Python float (the last micro-batch's)."""
    device = next((p.device for p in recipe.model.parameters()), torch.device("cpu"))
    with _rng_at_first_forward(recipe.model, rng):
        return float(train_step(recipe, _to_device(batch, device), on_phase=on_phase))


def _lr(recipe: Recipe) -> float | None:
    g = recipe.optimizer.param_groups
    return float(g[0]["lr"]) if g and "lr" in g[0] else None


def state_nonfinite(recipe: Recipe) -> bool:
    """Parameters, optimizer state or the learning rate hold a non-finite value."""
    with one_thread():
        return _state_nonfinite(recipe)


def _state_nonfinite(recipe: Recipe) -> bool:
    for p in recipe.model.parameters():
        if not is_finite(p.detach()):
            return True
        for v in recipe.optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and not is_finite(v):
                return True
    lr = _lr(recipe)
    return lr is not None and not math.isfinite(lr)


def rebuild(recipe: Recipe, steps: range, load: Callable[[int], tuple[Any, Any]],
            recorded: dict[int, float], result: Rebuilt | None = None, stop_on_break: bool = True) -> Rebuilt:
    """Re-execute ``steps`` on ``recipe`` (already holding snapshot S) and compare the losses.

    Args:
        load: ``step -> (batch, rng state)`` from the capture.
        recorded: step -> recorded loss.
        stop_on_break: stop after the first step that leaves a non-finite loss or state.
    """
    out = result or Rebuilt()
    for s in steps:
        batch, rng = load(s)
        loss = run_step(recipe, batch, rng)
        out.compare(s, loss, recorded.get(s))
        if not math.isfinite(loss) or state_nonfinite(recipe):
            if out.broke is None:
                out.broke = s
            if stop_on_break:
                break
    return out
