"""Preflight for a Lightning module or a Hugging Face model, built the way the integrations build them.

- Lightning: the optimizer is ``configure_optimizers()`` parsed by Lightning's own parser (the
  helper :mod:`sentineld.integrations.lightning_replay` uses; a scheduler is left out, as in every
  preflight); the loss of a batch is ``training_step(batch, batch_idx)`` (its ``"loss"`` when it
  returns a dict), ``batch_idx`` counting the batches drawn.
- Hugging Face: the loss is ``model(**batch).loss`` (:func:`sentineld.integrations.transformers_replay.model_loss`);
  without an optimizer, AdamW with the Trainer's defaults (lr 5e-5, betas (0.9, 0.999), eps 1e-8,
  weight decay 0); dict batches split into inputs and their ``"labels"``.

lightning and transformers are never imported here: a model is one of theirs only when its package
is already in ``sys.modules`` (it must be, for the model to exist).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Iterator

import torch

from .context import slice_batch, split_batch

__all__ = ["framework_of", "derive", "HF_ADAMW"]

#: The HF Trainer's AdamW defaults (TrainingArguments: learning_rate, adam_beta1/2, adam_epsilon, weight_decay).
HF_ADAMW = {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning_package(model: Any) -> str | None:
    for name in _LIGHTNING_PACKAGES:
        mod = sys.modules.get(name)
        if mod is not None and isinstance(model, getattr(mod, "LightningModule", ())):
            return name
    return None


def framework_of(model: Any) -> str | None:
    """``"lightning"`` for a LightningModule, ``"hf"`` for a transformers PreTrainedModel, else None."""
    if _lightning_package(model):
        return "lightning"
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        return "hf"
    return None


def _iterable(batches: Iterable[Any]) -> Iterable[Any]:
    if isinstance(batches, (torch.Tensor, dict)) or not hasattr(batches, "__iter__"):
        raise TypeError("batches must be an iterable of batches (a DataLoader, a list); "
                        "wrap a single batch as [batch]")
    return batches


def _training_step_loss(model: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
    out = model.training_step(micro["batch"], micro["batch_idx"])  # type: ignore[operator]
    loss = out.get("loss") if isinstance(out, dict) or hasattr(out, "keys") else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{type(model).__name__}.training_step returned {type(out).__name__}, "
                         "not a loss tensor or a dict with 'loss'")
    return loss


def _numbered(batches: Iterable[Any], first_cut: int) -> Iterator[dict[str, Any]]:
    """``{"batch", "batch_idx"}`` as the Lightning callback records them; the first batch is cut to
    Rule #1's size here, since the runner cannot see samples inside the wrapper."""
    for i, b in enumerate(batches):
        yield {"batch": slice_batch(b, first_cut) if i == 0 else b, "batch_idx": i}


def _hf_split(batch: Any) -> tuple[Any, Any]:
    """Inputs and ``"labels"`` of a Trainer batch; inputs are the usual key, else its first other tensor."""
    inputs, labels = split_batch(batch)
    if isinstance(batch, dict) and "labels" in batch and inputs is None:
        inputs = next((v for k, v in batch.items() if k != "labels" and isinstance(v, torch.Tensor)), None)
    return inputs, labels


def derive(kind: str | None, model: Any, optimizer: Any, loss_fn: Any, batches: Iterable[Any],
           split: Callable[[Any], tuple[Any, Any]] | None,
           overfit_samples: int) -> tuple[torch.optim.Optimizer, Callable[..., torch.Tensor], Iterable[Any], Any]:
    """What :func:`sentineld.preflight.check` needs and the framework knows, for a model given
    without ``optimizer`` or ``loss_fn``: ``(optimizer, loss_fn, batches, split)``.

    Args:
        kind: :func:`framework_of` the model (``"lightning"`` or ``"hf"``).
        overfit_samples: Rule #1's batch size (a Lightning batch is cut to it here: the runner
            cannot see samples inside the ``{"batch", "batch_idx"}`` wrapper).

    Raises:
        ValueError: ``configure_optimizers()`` returns several optimizers (manual optimization).
        TypeError: ``batches`` is not an iterable of batches; or the model is neither a
            LightningModule (with ``loss_fn`` None) nor a transformers model, so the missing
            optimizer / loss_fn cannot be derived.
    """
    if kind == "lightning" and loss_fn is None:
        from sentineld.integrations.lightning_replay import _parse_optimizers  # noqa: PLC0415

        package = _lightning_package(model) or "lightning.pytorch"
        if optimizer is None:
            optimizer, _ = _parse_optimizers(package, model.configure_optimizers())
        inner = split or split_batch
        return (optimizer, _training_step_loss, _numbered(_iterable(batches), int(overfit_samples)),
                lambda micro: inner(micro["batch"]))
    if kind == "hf" and loss_fn is None:
        from sentineld.integrations.transformers_replay import model_loss  # noqa: PLC0415

        if optimizer is None:
            optimizer = torch.optim.AdamW(model.parameters(), **HF_ADAMW)  # type: ignore[arg-type]
        return optimizer, model_loss, batches, split or _hf_split
    raise TypeError(f"optimizer and loss_fn are required for a {type(model).__name__}; they can be left "
                    "out only for a LightningModule (configure_optimizers/training_step) or a "
                    "transformers model (AdamW, model(**batch).loss)")
