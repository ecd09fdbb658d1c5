"""The snapshot layout: what "the state before step S" holds, written by the agent, stored in a
capture's ``/snapshot`` and loaded by the replay (through the recipe's objects).

A snapshot is a dict ``{"model", "optimizer", "scheduler", "scaler"}`` of state dicts (scheduler
and scaler None when the run has none), plus ``"grads"`` (parameter name -> gradient) only in a
loop that does not zero gradients before the forward: there the next step adds to them, so they
are part of the state. Plain Python: the objects' own ``state_dict``/``load_state_dict`` do the
tensor work.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["MODEL", "OPTIMIZER", "SCHEDULER", "SCALER", "GRADS", "state_of", "load_into", "grads_of"]

MODEL, OPTIMIZER, SCHEDULER, SCALER, GRADS = "model", "optimizer", "scheduler", "scaler", "grads"


def state_of(model: Any, optimizer: Any, scheduler: Any = None, scaler: Any = None,
             grads: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of these objects (references to their state, not copies).

    Args:
        grads: gradients carried into the next step, by parameter name; left out when empty.
    """
    state: dict[str, Any] = {
        MODEL: model.state_dict(),
        OPTIMIZER: optimizer.state_dict(),
        SCHEDULER: None if scheduler is None else scheduler.state_dict(),
        SCALER: None if scaler is None else scaler.state_dict(),
    }
    if grads:
        state[GRADS] = dict(grads)
    return state


def load_into(state: Mapping[str, Any], model: Any, optimizer: Any, scheduler: Any = None,
              scaler: Any = None) -> None:
    """Load a snapshot into these objects (scheduler/scaler entries missing or None are skipped;
    gradients are not loaded: see :func:`grads_of`).

    Raises:
        KeyError: no model or optimizer state; whatever ``load_state_dict`` raises on a mismatch.
    """
    model.load_state_dict(state[MODEL])
    optimizer.load_state_dict(state[OPTIMIZER])
    if scheduler is not None and state.get(SCHEDULER) is not None:
        scheduler.load_state_dict(state[SCHEDULER])
    if scaler is not None and state.get(SCALER) is not None:
        scaler.load_state_dict(state[SCALER])


def grads_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """The gradients a snapshot carries into its step, by parameter name (usually none)."""
    return dict(state.get(GRADS) or {})
