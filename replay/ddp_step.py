"""One DistributedDataParallel step re-executed in one process, as pure tensor math.

DDP on W ranks runs, per step: on every rank ``r``, the forward on rank r's batch (with rank r's
RNG, after DDP broadcast rank 0's buffers into the model) and the backward; the reducer copies
each gradient into its bucket multiplied by ``1/W`` (``reducer.cpp``: ``mul_out(bucket_view, grad,
1/div_factor)``) and all-reduces the buckets with a sum; then every rank runs the same optimizer
step on the same averaged gradients. The replay runs that sequence with one model:

- :func:`ddp_recipe` turns the run's :class:`Recipe` into one whose step takes the W ranks'
  batches as W micro-batches: :func:`sentineld.contracts.recipe.train_step` backwards each one
  unscaled, a gradient hook multiplies it by ``1/W`` (the reducer's product), and autograd's
  gradient accumulation sums the ranks' products in rank order (the all-reduce's sum).
- Before rank r's forward its recorded RNG state is restored (at the model's first training
  forward, where the agent read it) and the buffers are rank 0's buffers from the step's start
  (DDP's broadcast); after the step the model keeps rank 0's updated buffers.

For two ranks the sum ``a + b`` is the same in any order, so the rebuilt step is bit for bit the
run's. For more ranks gloo's ring all-reduce adds the ranks' products in an order that depends on
the chunk of the bucket, so rebuilt values may differ from the run's in the last bits (the replay
states a tolerance, :func:`loss_tolerance`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rng import restore_rng

__all__ = ["DdpStep", "ddp_recipe", "loss_tolerance", "BITWISE_WORLD"]

#: Largest world size whose all-reduce sum the replay reproduces bit for bit (``a + b == b + a``).
BITWISE_WORLD = 2


def loss_tolerance(world: int, loss: float) -> float:
    """Largest |rebuilt - recorded| loss accepted for a run of ``world`` ranks at loss ``loss``.

    0 (bit for bit) up to :data:`BITWISE_WORLD` ranks. Beyond, the gradient sum's order differs
    from gloo's ring order: each averaged gradient element may differ by about ``W`` float32 ulps
    (relative ``W * 2**-24``), an optimizer step carries that into the parameters, and a loss
    rebuilt a few steps later differs by a similar relative amount. The tolerance allows 1e-4
    relative (about 100x that, for a few steps of growth), with an absolute floor of 1e-6.
    """
    if world <= BITWISE_WORLD:
        return 0.0
    return max(1e-6, 1e-4 * abs(loss)) if loss == loss else 0.0


@dataclass
class DdpStep:
    """What one replayed DDP step needs and leaves behind (mutated by the step's loss function).

    Attributes:
        world: number of ranks (micro-batches per step).
        rngs: rank -> RNG state read at that rank's first training forward of the step (or None).
        losses: rank -> the rank's loss of the step as a Python float (filled by the step).
    """

    world: int
    rngs: list[Any] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    _i: int = 0
    _pending: Any = None
    _start: dict[str, torch.Tensor] = field(default_factory=dict)
    _rank0_after: dict[str, torch.Tensor] = field(default_factory=dict)

    def begin(self, rngs: list[Any]) -> None:
        """Start a step whose ranks' RNG states are ``rngs`` (rank order)."""
        self.rngs, self.losses, self._i, self._pending = list(rngs), [], 0, None


def _buffers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    return {f"{mn}.{bn}" if mn else bn: (m, bn) for mn, m in model.named_modules()
            for bn, b in m._buffers.items() if b is not None}


def _bind(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    # Rebinding (not copy_) leaves tensors an earlier rank's autograd graph saved untouched.
    owners = _buffers(model)
    for name, t in values.items():
        m, bn = owners[name]
        m._buffers[bn] = t


def _current(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m._buffers[bn] for name, (m, bn) in _buffers(model).items()}  # type: ignore[misc]


def _rank_loss(state: DdpStep, user_loss: Any) -> Any:
    """The DDP recipe's loss function: one rank's forward, with its buffers and RNG."""

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        r = state._i % state.world
        state._i += 1
        if r == 0:
            state._start = {n: t.detach().clone() for n, t in _current(model).items()}
        else:
            _bind(model, {n: t.clone() for n, t in state._start.items()})  # DDP's broadcast from rank 0
        state._pending = state.rngs[r] if r < len(state.rngs) else None
        out = user_loss(model, batch)
        if r == 0:
            state._rank0_after = _current(model)
        if r == state.world - 1 and state.world > 1:
            _bind(model, state._rank0_after)  # the next step starts from rank 0's buffers
        state.losses.append(float(out.detach().float()) if out.numel() == 1 else float("nan"))
        return out

    return loss_fn


@contextlib.contextmanager
def ddp_recipe(recipe: Recipe, world: int) -> Iterator[tuple[Recipe, DdpStep]]:
    """A recipe whose step is one DDP step of ``recipe`` over ``world`` ranks' batches.

    Yields ``(ddp, state)``: call ``state.begin(rngs)`` before each step, then run ``ddp`` through
    :func:`sentineld.replay.rebuild.run_step` with the list of the ranks' batches (rank order) and
    ``rng=None``; ``state.losses`` then holds every rank's loss. The gradient hooks are removed
    on exit; ``ddp`` shares model and optimizer with ``recipe``.

    Raises:
        ValueError: ``world < 1``, or the recipe accumulates micro-batches (a DDP run with
            ``no_sync`` accumulation is not replayed yet: replay one rank with ``--rank``).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if recipe.accumulation_steps != 1:
        raise ValueError("replaying a DDP run whose recipe accumulates micro-batches is not supported; "
                         "replay one rank's capture with --rank R")
    state = DdpStep(world)
    ddp = replace(recipe, loss_fn=_rank_loss(state, recipe.loss_fn), accumulation_steps=world,
                  scale_accumulated=False)
    inv = 1.0 / world
    hooks = [p.register_hook(lambda g: g * inv) for p in recipe.model.parameters() if p.requires_grad] \
        if world > 1 else []

    def restore(module: torch.nn.Module, args: Any) -> None:
        if state._pending is not None and module.training and torch.is_grad_enabled():
            rng, state._pending = state._pending, None
            restore_rng(dict(rng))

    hooks.append(recipe.model.register_forward_pre_hook(restore))
    try:
        yield ddp, state
    finally:
        for h in hooks:
            h.remove()
