"""How a run's training step is rebuilt: the :class:`Recipe` and the canonical :func:`train_step`.

The replay must re-execute the exact step the run executed. The run names a function
(``attach(..., recipe="train:make_recipe")``) that builds a fresh model, optimizer and loss; the
replay imports it from the run's working directory, loads the captured state into it, and drives
the step with :func:`train_step`. A loop that calls :func:`train_step` itself, or writes the same
sequence by hand (zero_grad, forward, backward, clip, optimizer step, scheduler step), is replayed
bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sentineld.contracts.snapshot import load_into

__all__ = ["Recipe", "train_step", "PHASES", "mark_phase"]

#: Phases of one step, in order, as reported to ``on_phase``.
PHASES = ("forward", "backward", "clip", "optimizer", "scheduler")


@dataclass
class Recipe:
    """Everything needed to run one training step.

    Attributes:
        model: the module, on its device.
        optimizer: the optimizer over ``model``'s parameters.
        loss_fn: ``(model, batch) -> loss`` returning a scalar tensor; runs the forward pass.
        scheduler: LR scheduler stepped once after each optimizer step, or None.
        scaler: ``torch.amp.GradScaler`` or None.
        clip_grad_norm: max global L2 norm for ``clip_grad_norm_`` before the step, or None.
        accumulation_steps: micro-batches per optimizer step; the batch is then a list of them.
        zero_grad: False reproduces a loop that never zeroes gradients (a known bug).
        autocast_dtype: dtype for ``torch.autocast`` around the forward pass, or None.
        num_classes: C of a C-class classification loss (enables the ln(C) first-loss check).
        scale_accumulated: divide each micro-batch's loss by the number of micro-batches before
            backward (False: ``loss_fn`` already normalizes over the whole accumulated batch, as
            the Hugging Face Trainer's models do when given ``num_items_in_batch``).
        manual: ``loss_fn`` runs the whole step itself: its backward passes and optimizer steps
            (Lightning's manual optimization, a GAN's two optimizers); :func:`train_step` then only
            zeroes the gradients and calls it, and ``loss_fn`` marks its phases with
            :func:`mark_phase`.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    scheduler: Any = None
    scaler: Any = None
    clip_grad_norm: float | None = None
    accumulation_steps: int = 1
    zero_grad: bool = True
    autocast_dtype: torch.dtype | None = None
    num_classes: int | None = None
    scale_accumulated: bool = True
    manual: bool = False

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a snapshot (:mod:`sentineld.contracts.snapshot`) into this recipe's objects."""
        load_into(state, self.model, self.optimizer, self.scheduler, self.scaler)


_PHASE: contextvars.ContextVar[Callable[[str], None]] = contextvars.ContextVar(
    "sentineld_phase", default=lambda _name: None)


def mark_phase(name: str) -> None:
    """Mark a phase (one of :data:`PHASES`) from inside the ``loss_fn`` of a ``manual`` recipe."""
    _PHASE.get()(name)


def _device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _forward(recipe: Recipe, micro_batch: Any, phase: Callable[[str], None]) -> torch.Tensor:
    """``recipe.loss_fn`` on one micro-batch, under the recipe's autocast (the forward phase of
    both a normal and a manual step)."""
    phase("forward")
    ctx = (torch.autocast(_device_type(recipe.model), dtype=recipe.autocast_dtype)
           if recipe.autocast_dtype is not None else contextlib.nullcontext())
    with ctx:
        loss: torch.Tensor = recipe.loss_fn(recipe.model, micro_batch)
    return loss


def train_step(recipe: Recipe, batch: Any, on_phase: Callable[[str], None] | None = None) -> torch.Tensor:
    """Run one optimizer step of ``recipe`` on ``batch`` and return the (detached) loss.

    The sequence: zero_grad (set_to_none) -> per micro-batch: forward under autocast, backward of
    loss / accumulation_steps (scaled by the GradScaler) -> unscale + clip -> optimizer step
    (through the scaler) -> scheduler step. ``on_phase(name)`` is called before each phase
    (names in :data:`PHASES`); the replay uses it to tell forward from backward from optimizer.

    Args:
        batch: whatever ``loss_fn`` takes; a list of ``accumulation_steps`` of them when accumulating.

    Returns:
        The last micro-batch's loss as returned by ``loss_fn``, detached (shape ``()``).

    Raises:
        ValueError: an accumulating recipe got a batch that is not a list of the declared length.
    """
    phase = on_phase or (lambda _name: None)
    model, opt, scaler = recipe.model, recipe.optimizer, recipe.scaler
    if recipe.zero_grad:
        opt.zero_grad(set_to_none=True)
    if recipe.accumulation_steps > 1:
        if not isinstance(batch, (list, tuple)) or len(batch) != recipe.accumulation_steps:
            raise ValueError(f"an accumulating recipe needs a list of {recipe.accumulation_steps} "
                             "micro-batches")
        micro = list(batch)
    else:
        micro = [batch]
    loss = torch.zeros(())
    if recipe.manual:
        token = _PHASE.set(phase)
        try:
            for mb in micro:
                loss = _forward(recipe, mb, phase)
        finally:
            _PHASE.reset(token)
        return loss.detach()  # its schedulers too are stepped by loss_fn, if at all
    for mb in micro:
        loss = _forward(recipe, mb, phase)
        phase("backward")
        scaled = loss / len(micro) if len(micro) > 1 and recipe.scale_accumulated else loss
        if scaler is not None:
            scaled = scaler.scale(scaled)
        scaled.backward()
    if recipe.clip_grad_norm is not None:
        phase("clip")
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
    phase("optimizer")
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if recipe.scheduler is not None:
        phase("scheduler")
        recipe.scheduler.step()
    return loss.detach()
