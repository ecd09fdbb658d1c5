"""The replay side of the Lightning callback: rebuild the LightningModule from ``run.json``.

``run.json`` of a run watched by :class:`sentineld.integrations.lightning.SentineldCallback`
names :func:`recipe_from_run` as its recipe, with the module's class path and the
hyperparameters ``save_hyperparameters()`` recorded. The replay then needs no user code:

- the class is imported from its module, or, when it lives in the training script
  (``__main__``), loaded from the script by path so the training behind
  ``if __name__ == "__main__":`` does not run (:mod:`sentineld.integrations.codeload`);
- ``cls(**hparams)``, moved to the run's device, then ``configure_optimizers()`` parsed the way
  Lightning parses it (one optimizer; a ``"step"``-interval scheduler is stepped after each
  optimizer step as Lightning does, an ``"epoch"`` one is left out of the rebuilt steps);
- the loss of one micro-batch ``{"batch", "batch_idx"}`` is ``training_step(batch, batch_idx)``
  (its ``"loss"`` when it returns a dict), under the run's precision (``bf16-mixed`` /
  ``16-mixed`` autocast, the GradScaler of ``16-mixed``), with its accumulation and
  norm clipping, and with the trainer state recorded for that micro-batch
  (:mod:`.lightning_state`: ``self.global_step``, ``self.current_epoch``, silent ``self.log``);
- manual optimization: every optimizer of ``configure_optimizers()`` (one
  :class:`~.lightning_state.JointOptimizer` over several, as the callback snapshotted them), and
  ``training_step`` runs the whole step itself (``Recipe.manual``) through Lightning's own
  ``LightningOptimizer`` wrapper.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from sentineld.contracts.recipe import Recipe, mark_phase

from .codeload import load_class

__all__ = ["recipe_from_run", "hparams_problem", "training_step_loss", "LiveStepLoss"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def hparams_problem(cls: type, saved: bool) -> str | None:
    """Why ``cls`` cannot be rebuilt from what the run recorded, or None when it can.

    A module that never called ``save_hyperparameters()`` can still be rebuilt when its
    ``__init__`` takes no required argument.
    """
    if saved:
        return None
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        params = []
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        return None
    return (f"{cls.__name__}.__init__ takes {required} but the module never called "
            "self.save_hyperparameters(); add `self.save_hyperparameters()` as the first line of "
            f"{cls.__name__}.__init__ so the replay can rebuild it (or pass recipe= to the callback)")


def training_step_loss(model: torch.nn.Module, micro: Any) -> torch.Tensor:
    """The loss of one recorded micro-batch: ``training_step(batch, batch_idx)``.

    The module is first called once with an empty forward: its forward pre-hooks mark "the first
    training forward of the step", where the replay restores the RNG state (the agent read it at
    ``on_train_batch_start``, just before ``training_step``). ``training_step`` itself then runs
    outside that call, so an op it runs outside every submodule is reported as ``loss``, as for a
    plain loop's loss. It runs with the trainer state recorded for this micro-batch
    (``self.global_step``, ``self.current_epoch``; :class:`~.lightning_state.ReplayTrainer`).
    Under manual optimization ``training_step`` does the whole step (``manual_backward``,
    ``opt.step()``); its loss is what it returned, else the last ``manual_backward``'s loss.

    Raises:
        ValueError: the micro-batch is not ``{"batch", "batch_idx"}``, or ``training_step``
            returned no loss tensor.
        AttributeError: ``training_step`` read trainer state the replay did not record (named).
    """
    from .lightning_state import ReplayTrainer, attach_replay_trainer  # noqa: PLC0415

    if not isinstance(micro, dict) or "batch" not in micro:
        raise ValueError("a Lightning run's batch must be {'batch': ..., 'batch_idx': ...}")
    trainer = model.__dict__.get("_trainer")
    if not isinstance(trainer, ReplayTrainer):  # a copy of the live module (in-process) has none
        trainer = attach_replay_trainer(model, ReplayTrainer(phase=mark_phase))
    trainer.enter(micro)
    model.__dict__["forward"] = lambda *a, **k: None
    try:
        model()
    finally:
        del model.__dict__["forward"]
    cls: Any = type(model)  # a LightningModule (typed as the nn.Module the Recipe holds)
    out = cls.training_step(model, micro["batch"], int(micro.get("batch_idx", 0)))
    loss = out.get("loss") if isinstance(out, dict) or hasattr(out, "keys") else out
    if not isinstance(loss, torch.Tensor) and not getattr(model, "automatic_optimization", True):
        loss = trainer.strategy.last_backward
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{type(model).__name__}.training_step returned {type(out).__name__}, "
                         "not a loss tensor or a dict with 'loss'")
    return loss


class LiveStepLoss:
    """:func:`training_step_loss` for the training process's own localization (``loss_fn=``):
    it runs on a copy of the live module (a copy has no trainer), so it gives the copy the run's
    trainer settings, and the autocast Lightning's precision wraps ``training_step`` in (the
    agent reads autocast at the step's start, outside that context).

    Args:
        settings: :func:`~.lightning_state.trainer_settings` of the run.
        precision: the trainer's precision string.
        device_type: the module's device type (``cpu``, ``cuda``).
    """

    def __init__(self, settings: dict[str, Any], precision: str, device_type: str) -> None:
        self.settings, self.device_type = dict(settings), device_type
        self.autocast = _AUTOCAST.get(precision)

    def __call__(self, model: torch.nn.Module, micro: Any) -> torch.Tensor:
        from .lightning_state import ReplayTrainer, attach_replay_trainer  # noqa: PLC0415

        if not isinstance(model.__dict__.get("_trainer"), ReplayTrainer):
            attach_replay_trainer(model, ReplayTrainer(self.settings, phase=mark_phase))
        if self.autocast is None:
            return training_step_loss(model, micro)
        with torch.autocast(self.device_type, dtype=self.autocast):
            return training_step_loss(model, micro)


def _parse_optimizers(package: str, conf: Any) -> tuple[torch.optim.Optimizer, Any]:
    """One optimizer and its per-step scheduler (or None) from ``configure_optimizers()``'s output
    (automatic optimization; preflight's too)."""
    optimizers, _all, sched = _parse_all(package, conf, manual=False)
    return optimizers[0], sched


def _parse_all(package: str, conf: Any, manual: bool) -> tuple[list[torch.optim.Optimizer], list[Any], Any]:
    """``(optimizers, every scheduler, the per-step scheduler of automatic optimization or
    None)`` from ``configure_optimizers()``'s output, parsed by Lightning's own functions."""
    core = importlib.import_module(f"{package}.core.optimizer")
    optimizers, schedulers, monitor = core._configure_optimizers(conf)
    if manual:
        configs = core._configure_schedulers_manual_opt(schedulers)
        return list(optimizers), [c.scheduler for c in configs], None
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers() returned {len(optimizers)} optimizers under automatic "
                         "optimization; the replay rebuilds one (or manual optimization)")
    configs = core._configure_schedulers_automatic_opt(schedulers, monitor)
    sched = None
    for c in configs:
        if c.interval == "step" and not c.reduce_on_plateau:
            if c.frequency != 1:
                raise ValueError(f"a scheduler stepped every {c.frequency} batches is not "
                                 "replayable from the Lightning module alone; pass a recipe")
            sched = c.scheduler
    return list(optimizers), [c.scheduler for c in configs], sched


def recipe_from_run(*, module_class: dict[str, Any], lightning: str = "lightning.pytorch",
                    hparams: dict[str, Any] | None = None, hparams_saved: bool = False,
                    hparams_error: str | None = None, precision: str = "32-true",
                    accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
                    gradient_clip_algorithm: str = "norm", automatic_optimization: bool = True,
                    trainer: dict[str, Any] | None = None, device: str = "cpu", cwd: str = ".") -> Recipe:
    """Rebuild a Lightning run's step from what the callback wrote to ``run.json``.

    Args:
        module_class: ``{"module", "qualname", "script"}`` of the LightningModule.
        hparams: ``save_hyperparameters()``'s values (JSON).
        precision: the trainer's precision string (``32-true``, ``bf16-mixed``, ``16-mixed``...).
        trainer: per-run trainer values ``training_step`` may read
            (:func:`~.lightning_state.trainer_settings`).
        Others: the trainer's settings of the same name; ``device`` the module's device (CPU is
            used when that device is not available here).

    Returns:
        A :class:`Recipe` whose ``loss_fn`` is :func:`training_step_loss`.

    Raises:
        ValueError: the run cannot be rebuilt without user code (no hyperparameters saved,
            value clipping...), with what to add or change.
        UntrustedError: the training script or module is not safely ours (pass ``--trust``).
    """
    from sentineld.replay.trust import trust_given  # noqa: PLC0415

    if hparams_error:
        raise ValueError(hparams_error)
    if gradient_clip_val and gradient_clip_algorithm != "norm":
        raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not replayed "
                         "(only 'norm'); pass a recipe")
    cls = load_class(module_class, cwd, trust=trust_given())
    problem = hparams_problem(cls, hparams_saved)
    if problem:
        raise ValueError(problem)
    try:
        model = cls(**(hparams or {}))
    except TypeError as exc:
        raise ValueError(f"{cls.__name__}(**saved hyperparameters) failed: {exc}. Every __init__ "
                         "argument left out of save_hyperparameters(ignore=...) needs a default") from None
    dev = torch.device(device)
    if dev.type != "cpu" and not (dev.type == "cuda" and torch.cuda.is_available()):
        dev = torch.device("cpu")
    model.to(dev).train()
    from .lightning_state import JointOptimizer, ReplayTrainer, attach_replay_trainer  # noqa: PLC0415

    manual = not automatic_optimization
    optimizers, schedulers, scheduler = _parse_all(lightning, model.configure_optimizers(), manual)
    attach_replay_trainer(model, ReplayTrainer({**(trainer or {}), "lightning_package": lightning},
                                               optimizers, schedulers, phase=mark_phase))
    scaler = torch.amp.GradScaler(dev.type) if precision in ("16-mixed", "16") else None
    if manual:  # training_step steps its optimizers itself; one snapshot holds them all
        if scaler is not None:
            raise ValueError("manual optimization under 16-mixed is not replayed; pass a recipe")
        optimizer = optimizers[0] if len(optimizers) == 1 else JointOptimizer(optimizers)
        # zero_grad=False: Lightning zeroes nothing itself there; gradients a step leaves (a GAN's
        # discriminator after the generator's backward) are in the snapshot and carried on.
        return Recipe(model=model, optimizer=optimizer, loss_fn=training_step_loss, manual=True,
                      zero_grad=False, autocast_dtype=_AUTOCAST.get(precision))
    return Recipe(model=model, optimizer=optimizers[0], loss_fn=training_step_loss, scheduler=scheduler,
                  scaler=scaler, clip_grad_norm=float(gradient_clip_val) if gradient_clip_val else None,
                  accumulation_steps=max(1, int(accumulate_grad_batches)),
                  autocast_dtype=_AUTOCAST.get(precision))
