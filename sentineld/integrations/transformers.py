"""Hugging Face Trainer: ``Trainer(..., callbacks=[SentineldCallback()])`` is the only change.

::

    from sentineld.integrations.transformers import SentineldCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SentineldCallback(run_id="exp1")])
    trainer.train()

A Trainer callback sees neither the batch nor the loss tensor, so the callback takes them from
the model: a forward pre-hook (with kwargs: the Trainer calls ``model(**inputs)``) records each
training micro-batch, a forward hook keeps ``outputs.loss`` (a reference, read by the agent
without a host sync). The step is recorded at ``on_optimizer_step`` (after ``optimizer.step()``,
before the LR scheduler steps and gradients are zeroed). Accumulation comes from
``gradient_accumulation_steps``, clipping from ``max_grad_norm``, precision from ``bf16``/``fp16``
(and the accelerator's GradScaler), optimizer and scheduler from inside accelerate's wrappers.

Step numbers are the Trainer's ``state.global_step`` once the step is done: the first step is 1,
the 31st is 31, as in the Trainer's logs and ``checkpoint-31``. The grad norm recorded is the one
before clipping: with ``max_grad_norm > 0`` (1.0 by default) the Trainer's own clip is wrapped on
the instance and its return value (the pre-clip norm, after unscaling) recorded, because the
optimizer's pre-hook, the agent's usual point, runs after the clip; each record says ``clipped``.
The training process localizes its own incidents with ``model(**batch).loss`` (not under DDP, not
for a model that normalizes its loss over an accumulated batch, and not with ``localize="off"``:
the daemon's replay does those).

The Trainer's ``logging_nan_inf_filter`` (on by default) logs a NaN loss as the running average
and trains on; the agent reads the model's own loss, so its alert fires at the first non-finite
step regardless.

The replay needs no user code: ``run.json`` names
:func:`sentineld.integrations.transformers_replay.recipe_from_run` with the model class, its
config (JSON), the optimizer's class and parameter groups and the scheduler's settings. A Trainer
subclass that overrides ``compute_loss`` (or a ``compute_loss_func``, or label smoothing) computes
a loss the model does not return: the run records that and the replay says to pass ``recipe=``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from typing import Any

from ._common import check_attach_kwargs, json_or_error, log
from .codeload import class_ref

try:
    from transformers import TrainerCallback as _Base
except ImportError as exc:  # pragma: no cover - this module is the transformers integration
    raise ImportError("sentineld.integrations.transformers needs the `transformers` package") from exc

__all__ = ["SentineldCallback", "RECIPE"]

#: The built-in recipe a Trainer run names in run.json.
RECIPE = "sentineld.integrations.transformers_replay:recipe_from_run"

_FROM_TRAINER = {"scheduler", "scaler", "accumulation_steps", "clip_grad_norm"}


def _find_trainer() -> Any:
    """The Trainer whose callback is running: the ``self`` of a caller frame.

    Callbacks are not given the Trainer; its settings that decide the loss (a ``compute_loss``
    override, ``compute_loss_func``, ``model_accepts_loss_kwargs``) live only there.
    """
    from transformers import Trainer  # noqa: PLC0415

    frame: Any = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _custom_loss(trainer: Any) -> str | None:
    """Why the model's ``outputs.loss`` is not the loss the Trainer trains on, or None."""
    from transformers import Trainer  # noqa: PLC0415

    if trainer is None:
        return None
    if type(trainer).compute_loss is not Trainer.compute_loss:
        return f"{type(trainer).__name__} overrides compute_loss"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "the Trainer was given compute_loss_func"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label_smoothing_factor > 0 (the Trainer smooths the loss itself)"
    return None


def _optimizer_args(opt: Any, model: Any) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for g in opt.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params" and json_or_error(v, k, "")[1] is None}
        groups.append({"params": [names.get(id(p), "") for p in g["params"]], **hyper})
    return {"class": class_ref(type(opt)), "groups": groups}


def replay_args(trainer: Any, args: Any, state: Any, model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """What :func:`~sentineld.integrations.transformers_replay.recipe_from_run` needs, as JSON."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    if trainer is not None:
        normalized = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    else:  # the Trainer's own rule when the model does not say
        params = inspect.signature(model.forward).parameters.values()
        normalized = getattr(model, "accepts_loss_kwargs", any(p.kind == p.VAR_KEYWORD for p in params))
    max_steps = int(state.max_steps)
    name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    scheduler = None if sched is None else {
        "name": str(name), "class": type(sched).__name__, "num_training_steps": max_steps,
        "num_warmup_steps": int(args.get_warmup_steps(max_steps)),
        "kwargs": json_or_error(dict(args.lr_scheduler_kwargs or {}), "lr_scheduler_kwargs", "")[0] or {}}
    return {"model_class": class_ref(type(model)), "config": config,
            "optimizer": _optimizer_args(opt, model), "scheduler": scheduler,
            "accumulation_steps": int(args.gradient_accumulation_steps),
            "max_grad_norm": float(args.max_grad_norm or 0.0), "bf16": bool(args.bf16),
            "fp16": bool(args.fp16), "loss_normalized": normalized,
            "custom_loss": _custom_loss(trainer), "device": str(model.device), "cwd": os.getcwd()}


def _loss_of(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    return loss.detach() if loss is not None and hasattr(loss, "detach") else None


class SentineldCallback(_Base):  # type: ignore[misc,valid-type]
    """Watches a Hugging Face ``Trainer.train()`` with the sentineld agent.

    Args:
        **attach_kwargs: :func:`sentineld.agent.attach`'s keywords (``run_id``, ``runs_dir``,
            ``recipe``/``recipe_args``, config fields such as ``metrics_port``...).
            ``scheduler``, ``scaler``, ``accumulation_steps`` and ``clip_grad_norm`` come from
            the Trainer.

    Attributes:
        watch: the :class:`sentineld.agent.Watch` while training runs.

    Raises:
        ValueError: an unknown keyword, or one the Trainer supplies.
    """

    def __init__(self, **attach_kwargs: Any) -> None:
        check_attach_kwargs(attach_kwargs, _FROM_TRAINER)
        self.attach_kwargs = attach_kwargs
        self.watch: Any = None
        self._micro: list[dict[str, Any]] = []
        self._loss: Any = None
        self._k = 1
        self._hooks: list[Any] = []
        self._warned: set[str] = set()
        self._trainer: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        from sentineld.agent import attach  # noqa: PLC0415

        if model is None or optimizer is None:
            log.warning("sentineld: the Trainer gave no model or optimizer; nothing to watch")
            return
        trainer = _find_trainer()
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # and AcceleratedScheduler
        kw = dict(self.attach_kwargs)
        kw["scheduler"] = sched
        accelerator = getattr(trainer, "accelerator", None)
        kw["scaler"] = getattr(accelerator, "scaler", None)
        self._k = kw["accumulation_steps"] = max(1, int(args.gradient_accumulation_steps))
        clip = float(args.max_grad_norm or 0.0)
        kw["clip_grad_norm"] = clip if clip > 0 else None  # for in-process localization
        if "recipe" not in kw:
            try:
                kw["recipe_args"] = replay_args(trainer, args, state, model, opt, sched)
                kw["recipe"] = RECIPE
            except Exception as exc:  # noqa: BLE001 - never stop training for what the replay needs
                log.warning("sentineld: cannot record how to rebuild %s (%r); the replay will need "
                            "--recipe", type(model).__name__, exc)
            if kw.get("recipe_args", {}).get("custom_loss"):
                log.warning("sentineld: %s; the replay cannot rebuild this loss from the model. "
                            "Pass recipe= (or loss_fn=) to SentineldCallback",
                            kw["recipe_args"]["custom_loss"])
        ra = kw.get("recipe_args") if kw.get("recipe") == RECIPE else None
        if (isinstance(ra, dict) and "loss_fn" not in kw and kw.get("localize") != "off"
                and not ra.get("custom_loss") and not (self._k > 1 and ra.get("loss_normalized"))
                and int(getattr(args, "world_size", 1)) == 1):
            # The training process localizes its own incidents with the model's own loss (a
            # loss normalized over the accumulated batch is left to the daemon's replay, whose
            # recipe does not divide it).
            from .transformers_replay import model_loss  # noqa: PLC0415

            kw["loss_fn"] = model_loss
        self.watch = attach(model, opt, **kw)
        # Steps are numbered as the Trainer numbers them: its global_step once the step is done
        # (the 31st step is 31 in its logs and in checkpoint-31).
        self.watch.start_at(int(state.global_step) + 1)
        self._hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
                       model.register_forward_hook(self._on_output)]
        if clip > 0:
            self._wrap_clip(trainer, clip)

    def _wrap_clip(self, trainer: Any, clip: float) -> None:
        """Record the Trainer's own pre-clip norm: its clip returns it, and the optimizer's
        pre-hook (the agent's usual point) runs after the clip, on clipped gradients."""
        original = getattr(trainer, "_clip_grad_norm", None)
        if original is None:
            log.warning("sentineld: this Trainer has no _clip_grad_norm; the recorded grad norm is "
                        "the clipped one (max_grad_norm=%g)", clip)
            return

        @functools.wraps(original)
        def clip_grad_norm(model: Any) -> Any:
            norm = original(model)
            w = self.watch
            if w is not None and norm is not None:
                import torch  # noqa: PLC0415

                w.grads_ready(norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm)),
                              clip_max=clip)
            return norm

        trainer._clip_grad_norm = clip_grad_norm
        self._trainer = trainer

    def _on_forward(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        import torch  # noqa: PLC0415

        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation
        if args and "positional" not in self._warned:
            self._warned.add("positional")
            log.warning("sentineld: the model was called with positional arguments; the replay "
                        "calls model(**batch) with the keyword arguments only")
        self._micro.append(dict(kwargs))

    def _on_output(self, module: Any, args: Any, out: Any) -> None:
        if module.training:
            self._loss = _loss_of(out)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        w = self.watch
        if w is None:
            return
        micro, self._micro = self._micro, []
        loss, self._loss = self._loss, None
        if loss is None or not micro:
            if "no loss" not in self._warned:
                self._warned.add("no loss")
                log.warning("sentineld: the model returned no loss (outputs.loss); steps are not "
                            "recorded. Pass labels in the batch")
            return
        w.step(loss, micro if self._k > 1 else micro[-1])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close("finished")

    def _close(self, reason: str) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._trainer is not None:
            self._trainer.__dict__.pop("_clip_grad_norm", None)
            self._trainer = None
        if self.watch is not None:
            self.watch.close(reason)
