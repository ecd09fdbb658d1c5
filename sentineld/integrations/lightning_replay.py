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
  norm clipping.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from sentineld.contracts.recipe import Recipe

from .codeload import load_class

__all__ = ["recipe_from_run", "hparams_problem", "training_step_loss"]

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
    plain loop's loss.

    Raises:
        ValueError: the micro-batch is not ``{"batch", "batch_idx"}``, or ``training_step``
            returned no loss tensor.
    """
    if not isinstance(micro, dict) or "batch" not in micro:
        raise ValueError("a Lightning run's batch must be {'batch': ..., 'batch_idx': ...}")
    model.__dict__["forward"] = lambda *a, **k: None
    try:
        model()
    finally:
        del model.__dict__["forward"]
    cls: Any = type(model)  # a LightningModule (typed as the nn.Module the Recipe holds)
    out = cls.training_step(model, micro["batch"], int(micro.get("batch_idx", 0)))
    loss = out.get("loss") if isinstance(out, dict) or hasattr(out, "keys") else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{type(model).__name__}.training_step returned {type(out).__name__}, "
                         "not a loss tensor or a dict with 'loss'")
    return loss


def _parse_optimizers(package: str, conf: Any) -> tuple[torch.optim.Optimizer, Any]:
    """One optimizer and its per-step scheduler (or None) from ``configure_optimizers()``'s output."""
    core = importlib.import_module(f"{package}.core.optimizer")
    optimizers, schedulers, monitor = core._configure_optimizers(conf)
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers() returned {len(optimizers)} optimizers; the "
                         "replay rebuilds one (manual optimization needs a recipe)")
    configs = core._configure_schedulers_automatic_opt(schedulers, monitor)
    sched = None
    for c in configs:
        if c.interval == "step" and not c.reduce_on_plateau:
            if c.frequency != 1:
                raise ValueError(f"a scheduler stepped every {c.frequency} batches is not "
                                 "replayable from the Lightning module alone; pass a recipe")
            sched = c.scheduler
    return optimizers[0], sched


def recipe_from_run(*, module_class: dict[str, Any], lightning: str = "lightning.pytorch",
                    hparams: dict[str, Any] | None = None, hparams_saved: bool = False,
                    hparams_error: str | None = None, precision: str = "32-true",
                    accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
                    gradient_clip_algorithm: str = "norm", automatic_optimization: bool = True,
                    device: str = "cpu", cwd: str = ".") -> Recipe:
    """Rebuild a Lightning run's step from what the callback wrote to ``run.json``.

    Args:
        module_class: ``{"module", "qualname", "script"}`` of the LightningModule.
        hparams: ``save_hyperparameters()``'s values (JSON).
        precision: the trainer's precision string (``32-true``, ``bf16-mixed``, ``16-mixed``...).
        Others: the trainer's settings of the same name; ``device`` the module's device (CPU is
            used when that device is not available here).

    Returns:
        A :class:`Recipe` whose ``loss_fn`` is :func:`training_step_loss`.

    Raises:
        ValueError: the run cannot be rebuilt without user code (no hyperparameters saved,
            manual optimization, value clipping...), with what to add or change.
        UntrustedError: the training script or module is not safely ours (pass ``--trust``).
    """
    from sentineld.replay.trust import trust_given  # noqa: PLC0415

    if hparams_error:
        raise ValueError(hparams_error)
    if not automatic_optimization:
        raise ValueError("the module uses manual optimization; the replay cannot know its steps. "
                         "Pass recipe= to SentineldCallback (see sentineld.recipe)")
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
    optimizer, scheduler = _parse_optimizers(lightning, model.configure_optimizers())
    scaler = torch.amp.GradScaler(dev.type) if precision in ("16-mixed", "16") else None
    return Recipe(model=model, optimizer=optimizer, loss_fn=training_step_loss, scheduler=scheduler,
                  scaler=scaler, clip_grad_norm=float(gradient_clip_val) if gradient_clip_val else None,
                  accumulation_steps=max(1, int(accumulate_grad_batches)),
                  autocast_dtype=_AUTOCAST.get(precision))
