"""A :class:`~sentineld.contracts.recipe.Recipe` made from the live training objects, for a run without a recipe.

``attach(model, optimizer, loss_fn=...)`` gives the agent everything a recipe module would: the
model's structure (the live module), the optimizer's class and param groups, the loss function,
and the scheduler, GradScaler, accumulation and clipping the agent was told of. Each
:meth:`LiveSpec.make` builds fresh copies with uninitialised tensors of the same shapes, dtypes and
devices; the replay engine then loads the capture's snapshot into them, exactly as it does with a
recipe's objects. The live objects are only read (never written) and no live tensor data is
copied, so building a copy costs allocation only.

Memory: one copy of the model's parameters and buffers plus, once the snapshot is loaded, the
optimizer's state (Adam: two more tensors per parameter), on the model's device, for as long as
the localization runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sentineld.contracts.recipe import Recipe

__all__ = ["LiveSpec", "copy_module", "copy_optimizer"]

# Hooks put in by sentineld itself (agent snapshots, per-layer probes) are not part of the model.
_OWN_PREFIXES = ("sentineld.", "agent.", "replay.")


def _ours(hook: Any) -> bool:
    fn = getattr(hook, "__func__", hook)
    return str(getattr(fn, "__module__", "") or "").startswith(_OWN_PREFIXES)


def _hook_dicts(m: torch.nn.Module) -> list[str]:
    """Attributes of ``m`` holding hook callables (``_forward_pre_hooks``, ...), not the
    bookkeeping dicts of hook ids (``_forward_pre_hooks_with_kwargs``: id -> bool)."""
    out = []
    for attr, val in vars(m).items():
        if "hooks" in attr and isinstance(val, dict):
            items = list(val.values())  # one C-level call: safe while the training thread runs
            if not items or any(callable(h) for h in items):
                out.append(attr)
    return out


def copy_module(live: torch.nn.Module, modes: list[bool] | None = None) -> torch.nn.Module:
    """A copy of ``live``'s structure with fresh, uninitialised parameters and buffers.

    Args:
        live: the training's module (only read).
        modes: ``[m.training for m in live.modules()]`` as recorded at the snapshot's step; default
            every module in training mode.

    Returns:
        The copy, on ``live``'s devices, with ``live``'s own hooks (re-bound to the copy) but not
        sentineld's. Parameters keep ``requires_grad``; tied parameters stay tied.
    """
    memo: dict[int, Any] = {}
    hooks: list[tuple[torch.nn.Module, str, list[tuple[Any, Any]]]] = []
    for m in live.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, memory_format=torch.preserve_format),
                                                 requires_grad=p.requires_grad)
        transient: set[str] = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in m.named_buffers(recurse=False):
            if id(b) not in memo:
                # A non-persistent buffer (BERT's position_ids) is in no state_dict, so no
                # snapshot brings it: copy its value (a constant, as a rule), not empty memory.
                memo[id(b)] = b.detach().clone() if name in transient else torch.empty_like(b)
        for attr in _hook_dicts(m):
            d = getattr(m, attr)
            hooks.append((m, attr, [(k, h) for k, h in list(d.items()) if not _ours(h)]))
            memo[id(d)] = type(d)()
    out = copy.deepcopy(live, memo)
    # Put the user's hooks back, copied with the same memo: a bound method of a live module
    # becomes one of its copy, a plain function stays itself.
    for m, attr, items in hooks:
        target = getattr(memo[id(m)], attr)
        for k, h in items:
            target[k] = copy.deepcopy(h, memo)
    mods = list(out.modules())
    for m, flag in zip(mods, modes if modes is not None and len(modes) == len(mods) else [True] * len(mods)):
        m.training = bool(flag)
    return out


def copy_optimizer(live: torch.optim.Optimizer, model_map: dict[int, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A copy of the live optimizer over the copied parameters, made without calling its
    constructor: an object of ``live``'s class given copies of its own attributes (a custom
    optimizer's ``loss_scale``, say), its defaults and its param groups (hyperparameters copied, so
    a scheduler stepping the copy never writes the live groups), with empty state (the replay loads
    the snapshot's). A constructor with required arguments (``StaticScaleAdam(params, lr,
    loss_scale)``) is therefore no obstacle. The live optimizer's hooks are not copied.

    Raises:
        TypeError: the optimizer holds tensors that are not parameters of the model.
    """
    from sentineld.contracts.structure import optimizer_internals  # noqa: PLC0415

    groups = []
    for g in list(live.param_groups):
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in model_map]
        if missing:
            raise TypeError(f"the optimizer holds tensors that are not parameters of the model (shapes "
                            f"{missing[:4]}); pass recipe='module:function' to attach instead")
        groups.append({**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                       "params": [model_map[id(p)] for p in g["params"]]})
    cls: Any = type(live)
    out = cls.__new__(cls)
    memo: dict[int, Any] = {id(k): v for k, v in ((p, model_map[id(p)]) for g in live.param_groups
                                                  for p in g["params"])}
    skip = optimizer_internals()
    for k, v in list(vars(live).items()):
        # Callables on the instance are wrappers others patched in (an LR scheduler wraps
        # ``step`` to count calls): copied, they would step the *live* optimizer.
        if k not in skip and not callable(v) and k != "_opt_called":
            object.__setattr__(out, k, copy.deepcopy(v, memo))
    torch.optim.Optimizer.__init__(out, groups, copy.deepcopy(dict(live.defaults)))
    return out


def _copy_scaler(scaler: Any) -> Any:
    if scaler is None:
        return None
    try:
        return type(scaler)(getattr(scaler, "_device", "cuda"), enabled=scaler.is_enabled())
    except TypeError:
        return copy.deepcopy(scaler)


@dataclass
class LiveSpec:
    """What builds an in-memory recipe from the live training objects (only read).

    Attributes:
        model: the live (unwrapped) module.
        optimizer: the live optimizer.
        loss_fn: ``(model, batch) -> scalar loss tensor``, as ``attach(loss_fn=)`` got it.
        scheduler, scaler: the live LR scheduler and GradScaler, or None.
        accumulation_steps, clip_grad_norm, num_classes: as given to ``attach``.
        zero_grad: False for a loop that carries gradients across steps.
        autocast_dtype: the dtype of the autocast the training forward ran under, or None.
        modes: ``training`` flag of every module at the snapshot's step (see :func:`copy_module`).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    scheduler: Any = None
    scaler: Any = None
    accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    num_classes: int | None = None
    zero_grad: bool = True
    autocast_dtype: torch.dtype | None = None
    modes: list[bool] | None = None

    def make(self) -> Recipe:
        """A fresh recipe over copies (uninitialised until the replay loads the snapshot)."""
        model = copy_module(self.model, self.modes)
        live_params = [p for _n, p in self.model.named_parameters(remove_duplicate=False)]
        copy_params = [p for _n, p in model.named_parameters(remove_duplicate=False)]
        pmap = {id(a): b for a, b in zip(live_params, copy_params)}
        opt = copy_optimizer(self.optimizer, pmap)
        sched = None
        if self.scheduler is not None:
            sched = copy.deepcopy(self.scheduler, {id(self.optimizer): opt})
        return Recipe(model=model, optimizer=opt, loss_fn=self.loss_fn, scheduler=sched,
                      scaler=_copy_scaler(self.scaler), clip_grad_norm=self.clip_grad_norm,
                      accumulation_steps=self.accumulation_steps, zero_grad=self.zero_grad,
                      autocast_dtype=self.autocast_dtype, num_classes=self.num_classes)
