"""What a LightningModule reads from its Trainer during a replayed ``training_step``.

A module's ``training_step`` may read ``self.global_step`` / ``self.current_epoch`` (a loss
annealed by step, a schedule of its own), call ``self.log``, and under manual optimization
``self.optimizers()``, ``self.manual_backward(loss)``, ``opt.step()``, ``opt.zero_grad()`` and
``self.lr_schedulers()``. It reads all of them through ``self.trainer``. The replay (the
``sentineld replay``, ``report`` and ``regress`` commands, and the training process's own
localization) runs ``training_step`` on a rebuilt module without a Trainer: a real Trainer
cannot run one recorded step from a snapshot. So :class:`ReplayTrainer` stands in for it with
the values the callback recorded:

- per micro-batch (in the recorded batch ``{"batch", "batch_idx", "global_step",
  "current_epoch"}``): ``global_step`` and ``current_epoch`` as ``training_step`` read them;
- per run (``run.json``): ``max_steps``, ``max_epochs``, ``accumulate_grad_batches``,
  ``precision``, ``world_size``... (:func:`trainer_settings`);
- the rebuilt optimizers (wrapped in Lightning's own ``LightningOptimizer``, so ``opt.step()``
  and ``opt.zero_grad()`` behave as in training) and LR schedulers;
- ``self.log`` / ``self.log_dict`` do nothing (the replay logs nothing).

Any other trainer attribute is state the replay did not restore: reading it raises an
AttributeError that names it, and :attr:`ReplayTrainer.unrestored` lists it, so a replay that
deviates says what it lacked instead of blaming non-determinism.

:class:`JointOptimizer` gives the agent one optimizer over a manual-optimization module's several
optimizers (a GAN's generator and discriminator): one snapshot holds every optimizer's state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["ReplayTrainer", "JointOptimizer", "trainer_settings", "micro_state", "RECORDED"]

#: Trainer attributes recorded with each micro-batch.
RECORDED = ("global_step", "current_epoch")

#: Trainer attributes recorded once per run (run.json), read back as they were.
_SETTINGS = ("max_steps", "max_epochs", "accumulate_grad_batches", "world_size", "num_devices",
             "num_nodes", "gradient_clip_val", "log_every_n_steps", "check_val_every_n_epoch")


def micro_state(trainer: Any) -> dict[str, int]:
    """``{"global_step", "current_epoch"}`` of ``trainer`` now (at a micro-batch's start)."""
    return {k: int(getattr(trainer, k)) for k in RECORDED}


def trainer_settings(trainer: Any) -> dict[str, Any]:
    """The per-run trainer values a module may read, as JSON (a value that is not a plain
    number or string is left out: the replay then does not restore it)."""
    out: dict[str, Any] = {}
    for name in _SETTINGS:
        try:
            value = getattr(trainer, name)
        except Exception:  # noqa: BLE001 - a property that cannot be computed here is simply not recorded
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
    out["precision"] = str(getattr(trainer, "precision", "32-true"))
    return out


class _Strategy:
    """The two strategy calls ``LightningModule.manual_backward`` and ``LightningOptimizer.step``
    make, done as Lightning's single-device strategy does them (``loss.backward()``,
    ``optimizer.step(closure)``); ``phase`` marks the replay's phases."""

    def __init__(self, phase: Callable[[str], None]) -> None:
        self.phase = phase
        self._lightning_optimizers: list[Any] = []
        #: The loss of the last ``manual_backward`` (the step's loss when training_step returns none).
        self.last_backward: torch.Tensor | None = None

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.last_backward = loss.detach()
        self.phase("backward")
        loss.backward(*args, **kwargs)
        self.phase("forward")
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self.phase("optimizer")
        out = optimizer.step(closure=closure, **kwargs)
        self.phase("forward")
        return out


class _SchedulerConfig:
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler


class ReplayTrainer:
    """Stands in for the Trainer while a rebuilt module's ``training_step`` replays a step.

    Args:
        settings: :func:`trainer_settings` of the run.
        optimizers: the rebuilt optimizers (in ``configure_optimizers`` order), or none.
        schedulers: the rebuilt LR schedulers, or none.
        phase: called with ``"backward"`` / ``"optimizer"`` / ``"forward"`` as a manual step
            goes (the replay's phase marks).
    """

    def __init__(self, settings: dict[str, Any] | None = None, optimizers: list[Any] | None = None,
                 schedulers: list[Any] | None = None, phase: Callable[[str], None] | None = None) -> None:
        d = self.__dict__
        d.update(settings or {})
        d["global_step"] = d["current_epoch"] = 0
        d["training"], d["sanity_checking"], d["barebones"] = True, False, False
        d["validating"] = d["testing"] = d["predicting"] = False
        d["global_rank"] = d["local_rank"] = d["node_rank"] = 0
        d["is_global_zero"] = True
        d["lr_scheduler_configs"] = [_SchedulerConfig(s) for s in schedulers or []]
        d["unrestored"] = []
        d["strategy"] = _Strategy(phase or (lambda _name: None))
        self.set_optimizers(optimizers or [])

    def set_optimizers(self, optimizers: list[Any]) -> None:
        """The optimizers ``self.optimizers()`` returns, wrapped as Lightning wraps them."""
        import importlib  # noqa: PLC0415

        package = self.__dict__.get("lightning_package", "lightning.pytorch")
        wrap = importlib.import_module(f"{package}.core.optimizer").LightningOptimizer
        strategy = self.__dict__["strategy"]
        self.__dict__["optimizers"] = list(optimizers)
        strategy._lightning_optimizers = [wrap._to_lightning_optimizer(o, strategy) for o in optimizers]

    def enter(self, micro: dict[str, Any]) -> None:
        """The recorded state of this micro-batch (older captures recorded none: left as is)."""
        for k in RECORDED:
            if isinstance(micro.get(k), int):
                self.__dict__[k] = micro[k]
        self.strategy.last_backward = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self.__dict__["unrestored"]:
            self.__dict__["unrestored"].append(name)
        raise AttributeError(f"the replay does not restore trainer.{name} (it recorded only "
                             f"{sorted(k for k in self.__dict__ if k not in ('unrestored', 'strategy'))}); "
                             "a training_step that reads it needs a recipe (recipe= to SentineldCallback)")


def _no_log(*_args: Any, **_kwargs: Any) -> None:
    """``self.log`` during a replay: nothing is logged."""


def attach_replay_trainer(model: Any, trainer: ReplayTrainer) -> ReplayTrainer:
    """Give ``model`` (and its LightningModule children) ``trainer``; ``log``/``log_dict`` off."""
    model.trainer = trainer
    for m in model.modules():
        if hasattr(type(m), "training_step"):
            m.__dict__["log"] = m.__dict__["log_dict"] = _no_log
    return trainer


class JointOptimizer(torch.optim.Optimizer):
    """Several optimizers seen as one by the agent (snapshots, grad norm) and the replay.

    ``param_groups`` is every optimizer's groups in order; ``state_dict()`` is
    ``{"optimizers": [each state_dict()]}`` and ``load_state_dict`` gives each its own. Its
    ``step`` steps each (the module's own code steps them one by one; the replay does too).
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:  # noqa: D107
        # Not Optimizer.__init__: that would build param groups of its own; the parts it sets
        # that hooks and zero_grad use are set here.
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        from collections import OrderedDict  # noqa: PLC0415

        self._optimizer_step_pre_hooks: Any = OrderedDict()
        self._optimizer_step_post_hooks: Any = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Any = OrderedDict()
        self._optimizer_state_dict_post_hooks: Any = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Any = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Any = OrderedDict()
        self._zero_grad_profile_name = "JointOptimizer.zero_grad"

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        out: dict[Any, Any] = {}
        for o in self.optimizers:
            out.update(o.state)
        return out

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        parts = state_dict["optimizers"]
        if len(parts) != len(self.optimizers):
            raise ValueError(f"the snapshot holds {len(parts)} optimizers, the module has {len(self.optimizers)}")
        for o, sd in zip(self.optimizers, parts):
            o.load_state_dict(sd)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = None
        for o in self.optimizers:
            out = o.step(closure) if closure is not None else o.step()
        return out

    def __repr__(self) -> str:
        return f"JointOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"
