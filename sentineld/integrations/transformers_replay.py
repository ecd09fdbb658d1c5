"""The replay side of the Hugging Face Trainer callback: rebuild model, optimizer and scheduler
from ``run.json``.

- the model: its class (a ``transformers`` class, or one in the user's module or training script,
  found as :mod:`sentineld.integrations.codeload` finds it) built from the stored config,
  ``cls(cls.config_class.from_dict(config))``; the snapshot then brings every weight;
- the optimizer: its class over the same parameter groups (by parameter name), the snapshot
  brings its state and hyperparameters;
- the scheduler: ``transformers.get_scheduler`` with the Trainer's settings (type, warmup, total
  steps), its state from the snapshot;
- the loss of one micro-batch: ``model(**batch).loss``, under ``bf16``/``fp16`` autocast, with
  ``max_grad_norm`` clipping and the accumulation as the Trainer did it (a model that takes
  ``num_items_in_batch`` already normalizes over the accumulated batch: no division).
"""

from __future__ import annotations

from typing import Any

import torch

from sentineld.contracts.recipe import Recipe

from .codeload import load_class

__all__ = ["recipe_from_run", "model_loss"]


def model_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` (a dict's ``"loss"``).

    Raises:
        ValueError: the batch is not a dict of keyword arguments, or the model returned no loss.
    """
    if not isinstance(batch, dict):
        raise ValueError(f"a Trainer run's batch must be a dict of model keyword arguments, got "
                         f"{type(batch).__name__}")
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{type(model).__name__}(**batch) returned no loss; the batch needs labels")
    return loss


def _optimizer(spec: dict[str, Any], model: torch.nn.Module, cwd: str, trust: bool) -> torch.optim.Optimizer:
    cls = load_class(spec["class"], cwd, trust=trust)
    params = dict(model.named_parameters())
    groups = []
    for g in spec["groups"]:
        missing = [n for n in g["params"] if n not in params]
        if missing:
            raise ValueError(f"the optimizer's parameters {missing[:4]} are not in the rebuilt model")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [params[n] for n in g["params"]]})
    return cls(groups)


def _scheduler(spec: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> Any:
    if spec is None:
        return None
    from transformers import get_scheduler  # noqa: PLC0415

    sched = get_scheduler(spec["name"], optimizer, num_warmup_steps=spec["num_warmup_steps"],
                          num_training_steps=spec["num_training_steps"],
                          scheduler_specific_kwargs=spec.get("kwargs") or None)
    if type(sched).__name__ != spec.get("class", type(sched).__name__):
        raise ValueError(f"the run's LR scheduler was a {spec['class']}, not the Trainer's "
                         f"{spec['name']!r} ({type(sched).__name__}); pass a recipe")
    return sched


def recipe_from_run(*, model_class: dict[str, Any], config: dict[str, Any],
                    optimizer: dict[str, Any], scheduler: dict[str, Any] | None = None,
                    accumulation_steps: int = 1, max_grad_norm: float = 0.0, bf16: bool = False,
                    fp16: bool = False, loss_normalized: bool = False, custom_loss: str | None = None,
                    device: str = "cpu", cwd: str = ".") -> Recipe:
    """Rebuild a Trainer run's step from what the callback wrote to ``run.json``.

    Args:
        model_class: ``{"module", "qualname", "script"}`` of the model.
        config: the model config as JSON (``config.to_json_string(use_diff=False)``).
        optimizer: ``{"class": {...}, "groups": [{"params": [names], <hyperparameters>}]}``.
        scheduler: ``{"name", "class", "num_warmup_steps", "num_training_steps", "kwargs"}`` or None.
        loss_normalized: the model took ``num_items_in_batch`` (the Trainer then does not divide
            the loss by the accumulation steps).
        custom_loss: why the model's loss is not the trained loss (a ``compute_loss`` override...).

    Raises:
        ValueError: the loss is not the model's own (``custom_loss``), or the model/optimizer
            cannot be rebuilt; the message says what to pass instead.
    """
    from sentineld.replay.trust import trust_given  # noqa: PLC0415

    if custom_loss:
        raise ValueError(f"{custom_loss}: the replay cannot rebuild the loss from the model alone. "
                         "Pass loss_fn= or recipe= to SentineldCallback (see sentineld.recipe)")
    trust = trust_given()
    cls = load_class(model_class, cwd, trust=trust)
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:
        raise ValueError(f"{cls.__name__} has no config_class; pass a recipe")
    model = cls(config_cls.from_dict(dict(config)))
    dev = torch.device(device)
    if dev.type != "cpu" and not (dev.type == "cuda" and torch.cuda.is_available()):
        dev = torch.device("cpu")
    model.to(dev).train()
    opt = _optimizer(optimizer, model, cwd, trust)
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    return Recipe(model=model, optimizer=opt, loss_fn=model_loss, scheduler=_scheduler(scheduler, opt),
                  scaler=torch.amp.GradScaler(dev.type) if fp16 else None,
                  clip_grad_norm=float(max_grad_norm) if max_grad_norm and max_grad_norm > 0 else None,
                  accumulation_steps=max(1, int(accumulation_steps)), autocast_dtype=dtype,
                  scale_accumulated=not loss_normalized)
