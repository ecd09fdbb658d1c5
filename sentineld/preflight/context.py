"""What every check shares: private copies of model and optimizer, the batches, the RNG guard.

The preflight must leave the user's objects alone: checks train, zero gradients and change
learning rates, so they run on :func:`copy_pair` copies, and :func:`rng_guard` puts the torch,
numpy and python ``random`` states back afterwards (iterating a shuffling DataLoader draws from
torch's generator).
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = ["Probe", "StepFn", "copy_pair", "rng_guard", "split_batch", "slice_batch", "default_step"]

#: ``step(model, optimizer, batch) -> loss``: one optimizer step, as the user's loop does it.
StepFn = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], torch.Tensor]

_LABEL_KEYS = ("labels", "label", "y", "target", "targets")
_INPUT_KEYS = ("input_ids", "x", "input", "inputs", "pixel_values", "image", "images", "features")


@contextlib.contextmanager
def rng_guard() -> Iterator[None]:
    """Restore torch (CPU and CUDA), numpy and python ``random`` states on exit."""
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(np_state)
        random.setstate(py_state)


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def _is_agent_hook(fn: Any) -> bool:
    """A hook that sentineld's agent (``attach``) registered: a bound method of an agent object."""
    owner = getattr(fn, "__self__", None)
    name = type(owner).__module__ if owner is not None else getattr(fn, "__module__", "") or ""
    return name.startswith("sentineld.agent")


@contextlib.contextmanager
def _agent_hooks_hidden(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hide the agent's hooks meanwhile; the original hook dicts (same objects) are put back.

    Copied, they would drag the whole Watch (locks, threads, files) into the deepcopy, and the
    copies' forwards and steps would be recorded as the user's run.
    """
    saved: list[tuple[Any, str, Any]] = []
    owners: list[tuple[Any, tuple[str, ...]]] = [(m, _MODULE_HOOKS) for m in model.modules()]
    owners += [(p, ("_backward_hooks",)) for p in model.parameters()] + [(optimizer, _OPTIMIZER_HOOKS)]
    for obj, attrs in owners:
        for attr in attrs:
            hooks = getattr(obj, attr, None)
            if hooks and any(_is_agent_hook(h) for h in hooks.values()):
                saved.append((obj, attr, hooks))
                setattr(obj, attr, type(hooks)((k, h) for k, h in hooks.items() if not _is_agent_hook(h)))
    try:
        yield
    finally:
        for obj, attr, hooks in saved:
            setattr(obj, attr, hooks)


def copy_pair(model: torch.nn.Module, optimizer: torch.optim.Optimizer
              ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Deep-copy model and optimizer together, so the copy's optimizer holds the copy's parameters.

    One ``deepcopy`` of the pair shares its memo: a parameter referenced by both (and as a key
    of the optimizer's state) becomes one new parameter. The user's own hooks are copied (they can
    be part of the model, e.g. weight norm); sentineld agent hooks are not.
    """
    with _agent_hooks_hidden(model, optimizer):
        return copy.deepcopy((model, optimizer))


def default_step(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> StepFn:
    """The four-step loop of the method: zero_grad, forward + loss, backward, optimizer step."""
    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Guess ``(inputs, labels)`` of a batch: ``(x, y, ...)`` tuples, dicts with usual keys, a tensor.

    Returns:
        ``(inputs, labels)``; either is None when it cannot be told.
    """
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        labels = next((batch[k] for k in _LABEL_KEYS if k in batch), None)
        inputs = next((batch[k] for k in _INPUT_KEYS if k in batch), None)
        return inputs, labels
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return None, None


def _batch_size(batch: Any) -> int | None:
    inputs, _ = split_batch(batch)
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() > 0 else None


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples: every tensor whose first dimension is the batch size is cut.

    Tuples, lists and dicts keep their type; anything else is returned as it is.
    """
    size = _batch_size(batch)
    if size is None or size <= n:
        return batch

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size:
            return v[:n]
        if isinstance(v, dict):
            return type(v)((k, cut(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(cut(x) for x in v)
        return v
    return cut(batch)


@dataclass
class Probe:
    """The inputs of every check.

    Attributes:
        model / optimizer: the user's objects; checks copy them with :meth:`fresh`, never touch them.
        loss_fn: ``(model, batch) -> loss``.
        step: one optimizer step (:func:`default_step` or the recipe's ``train_step``).
        batches: up to ``max_batches`` batches taken from the user's iterable.
        batch: the first batch cut to at most ``overfit_samples`` samples (Rule #1's batch).
        num_classes: C when known (given, or read off the traced loss).
        split: ``batch -> (inputs, labels)``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    step: StepFn
    batches: list[Any]
    batch: Any
    num_classes: int | None
    split: Callable[[Any], tuple[Any, Any]]

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A new private copy of (model, optimizer)."""
        return copy_pair(self.model, self.optimizer)
