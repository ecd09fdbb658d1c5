"""``attach(model, optimizer, ...)``: the agent's entry point (keywords checked against
:class:`~sentineld.agent.watch.Watch` and :class:`~sentineld.agent.agent_config.AgentConfig`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .agent_config import AgentConfig
from .watch import Watch

__all__ = ["attach"]


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Watch:
    """Attach the agent to ``model`` and ``optimizer``; returns the :class:`Watch`.

    Keyword Args:
        run_id: name of the run (default ``$SENTINELD_RUN_ID``, ``$TORCHELASTIC_RUN_ID``, or
            time-host-pid). All ranks of one job must share it.
        runs_dir: parent of run directories (default ``$SENTINELD_RUNS_DIR`` or the user state dir).
        recipe: ``"module:function"`` returning a :class:`sentineld.recipe.Recipe`; lets the
            replay rebuild model and loss from the run's working directory.
        recipe_args: JSON-ready keyword arguments for the recipe function (stored in run.json).
        scheduler, scaler: the LR scheduler and GradScaler, so snapshots include their state.
        num_classes: C of a C-class loss (enables the ln(C) initial-loss check).
        accumulation_steps: micro-batches per optimizer step (>1 disables the carried-grads check).
        loss_fn: ``(model, batch) -> scalar loss`` as the loop computes it: the training process
            then localizes its own incidents (see :mod:`sentineld.agent.localize_live`), no recipe
            needed. Without it and without a recipe, forward NaNs are still localized.
        localize: where the training process localizes its own incidents
            (``sentineld.contracts.verdict_file.LOCALIZE_MODES``): ``"auto"`` (default:
            ``"process"`` when the run's live objects can be rebuilt from their recorded
            structure, else ``"thread"``), ``"process"`` (a child process: a ``loss_fn`` that
            holds the GIL or hangs cannot stall training), ``"thread"`` (a background thread;
            memory: a second copy of model + optimizer state while it runs, logged at attach)
            or ``"off"`` (left to the daemon's replay). run.json records the mode chosen.
        clip_grad_norm: the max norm the loop clips gradients to (``clip_grad_norm_`` before
            ``optimizer.step()``): the recorded grad norm is then the pre-clip one, taken at the
            end of backward, and each record's ``clipped`` says whether the clip applied; the
            in-process replay clips the same way. Under DDP the norm stays the one at the step.
        signatures: this run's signature settings over the daemon's, e.g.
            ``{"plateau": {"enabled": False}, "exploding_gradients": {"ratio": 20.0}}`` (stored
            in run.json; keys as in the daemon config's ``signatures`` section, docs/signatures.md).
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
