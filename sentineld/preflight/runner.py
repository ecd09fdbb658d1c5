"""Running every preflight check in the method's priority order, on copies, RNG untouched."""

from __future__ import annotations

import dataclasses
import traceback
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .context import Probe, StepFn, copy_pair, default_step, rng_guard, slice_batch, split_batch
from .data_checks import check_inputs, check_labels
from .grad_checks import check_gradcheck, check_gradient_flow, check_gradients_applied
from .heldout import check_heldout
from .loss_checks import check_initial_loss, check_output_vs_loss, check_shapes
from .lossinfo import loss_info
from .result import FAIL, SKIP, Check
from .trace import trace_forward
from .training import check_lr_range, check_overfit
from .units import check_dead_units

__all__ = ["check", "check_recipe", "check_lightning", "check_hf"]

#: Rule #1's batch: "take 5-50 samples (typically one batch)"; 32 as in the method's example.
OVERFIT_SAMPLES = 32


def _safe(name: str, fn: Callable[[], Check]) -> tuple[Check, str | None]:
    """Run one check; an exception from the user's code (or ours) is a FAIL with its traceback.

    Returns:
        The check and, when it raised, the error as ``"Type: message"`` (else None).
    """
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the user's loss_fn/model can raise anything
        tb = traceback.format_exception(exc)
        error = f"{type(exc).__name__}: {exc}"
        return Check(name, FAIL, f"the check could not run: {error}",
                     {"traceback": "".join(tb[-3:])[-2000:]},
                     "fix the error first: it happens in one forward/backward/step of your code"), error


#: Checks on the data itself: when one of them fails, a later check that raises is taken as
#: raising because of that data (labels out of range make every cross-entropy raise).
_DATA_CHECKS = ("labels", "inputs")


def _run_in_order(steps: list[tuple[str, Callable[[], Check]]]) -> list[Check]:
    """Run the checks in order; one that raises after a failed data check, or with the same error
    as an earlier check, is SKIP (blocked by that check) instead of one more FAIL with a traceback:
    the user has one thing to fix, and the list says so."""
    out: list[Check] = []
    errors: dict[str, str] = {}  # error text -> first check that raised it
    for name, fn in steps:
        c, error = _safe(name, fn)
        if error is not None:
            blocker = next((d.name for d in out if d.name in _DATA_CHECKS and d.status == FAIL), None)
            blocker = blocker or errors.get(error)
            if blocker is not None:
                c = Check(name, SKIP, f"not run: it raises ({error.rstrip('.')}) because the {blocker} check failed",
                          {"blocked_by": blocker, "error": error[:500]},
                          f"fix the {blocker} check first, then rerun preflight")
            else:
                errors[error] = name
        out.append(c)
    return out


def _take(batches: Iterable[Any], n: int) -> list[Any]:
    if isinstance(batches, (torch.Tensor, dict)):
        raise TypeError("batches must be an iterable of batches (a DataLoader, a list); "
                        "wrap a single batch as [batch]")
    try:
        taken = list(islice(iter(batches), n))
    except TypeError:
        raise TypeError(f"batches must be an iterable of batches, got {type(batches).__name__}") from None
    except Exception as exc:  # noqa: BLE001 - the user's DataLoader / generator can raise anything
        raise ValueError(f"drawing the first {n} batches raised {type(exc).__name__}: {exc}; "
                         "fix the data pipeline (it fails before training would)") from None
    if not taken:
        raise ValueError("batches yielded no batch: preflight needs at least one")
    return taken


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
          batches: Iterable[Any] | None = None, num_classes: int | None = None, *, step: StepFn | None = None,
          split: Callable[[Any], tuple[Any, Any]] | None = None, max_batches: int = 8,
          overfit_samples: int = OVERFIT_SAMPLES, overfit_steps: int = 300, lr_range: bool = False,
          lr_plot: str | Path | None = None, _framework: str | None = None) -> list[Check]:
    """Run the preflight checks on copies of ``model`` and ``optimizer``.

    The user's model, optimizer (and their gradients) and the torch / numpy / python RNG states
    are unchanged afterwards; up to ``max_batches`` batches are drawn from ``batches``.

    Args:
        model: the module to train; a LightningModule or a transformers model may come without
            ``optimizer`` / ``loss_fn`` (see :mod:`sentineld.preflight.frameworks`).
        optimizer: the optimizer over its parameters (its class and hyper-parameters are used).
        loss_fn: ``(model, batch) -> loss`` (scalar tensor), as for ``attach(loss_fn=)``.
        batches: an iterable of training batches (a DataLoader, a list).
        num_classes: C of a C-class cross-entropy; default: read off the traced loss.
        step: ``(model, optimizer, batch) -> loss`` doing one optimizer step; default zero_grad,
            forward + loss, backward, optimizer.step().
        split: ``batch -> (inputs, labels)``; default guesses tuples and dicts.
        max_batches: batches drawn for the label/input statistics and the LR sweep.
        overfit_samples: Rule #1's batch size (the first batch is cut to it).
        overfit_steps: Rule #1's step budget.
        lr_range: also run the LR range test (check 11) and save its plot to ``lr_plot``.

    Returns:
        The checks in the method's priority order: labels, inputs, output_vs_loss, initial_loss,
        gradient_flow, gradients_applied, shapes, gradcheck, dead_units, overfit_one_batch,
        [lr_range].

    Raises:
        TypeError, ValueError: ``batches`` is not an iterable of at least one batch, or the model
            and optimizer cannot be deep-copied; ``optimizer`` or ``loss_fn`` is None for a model
            that is not a LightningModule or a transformers model; ``loss_fn`` returned no tensor.
    """
    if batches is None:
        raise TypeError("batches must be an iterable of batches, got NoneType (a DataLoader, a list)")
    if optimizer is None or loss_fn is None:
        from .frameworks import derive, framework_of  # noqa: PLC0415

        optimizer, loss_fn, batches, split = derive(_framework or framework_of(model), model, optimizer, loss_fn,
                                                    batches, split, overfit_samples)
    with rng_guard():
        torch.manual_seed(0)  # dropout masks, inits in loss_fn: the same verdicts on every run
        _copyable(model, optimizer)
        taken = _take(batches, max_batches)
        probe = Probe(model, optimizer, loss_fn, step or default_step(loss_fn), taken,
                      slice_batch(taken[0], overfit_samples), num_classes, split or split_batch)
        model_copy, _ = probe.fresh()
        partial = trace_forward(model_copy, probe.loss_fn, probe.batch)
        if partial.error is None and not isinstance(partial.loss, torch.Tensor):
            # Every check would fail on it with an AttributeError ('str' has no 'backward') naming no cause.
            raise TypeError(f"loss_fn returned {type(partial.loss).__name__}, not a tensor; it must return the "
                            "loss as a scalar tensor (e.g. F.cross_entropy(model(x), y)), as attach(loss_fn=) "
                            "and the replay expect")
        info = loss_info(partial)  # read even off a trace that raised: the labels check needs it
        trace = partial.error if partial.error is not None else partial
        if probe.num_classes is None:
            probe.num_classes = info.num_classes
        steps: list[tuple[str, Callable[[], Check]]] = [
            ("labels", lambda: check_labels(probe, info)),
            ("inputs", lambda: check_inputs(probe)),
            ("output_vs_loss", lambda: check_output_vs_loss(_need(trace))),
            ("initial_loss", lambda: check_initial_loss(_need(trace), info, probe.num_classes)),
            ("gradient_flow", lambda: check_gradient_flow(probe)),
            ("gradients_applied", lambda: check_gradients_applied(probe)),
            ("shapes", lambda: check_shapes(_need(trace))),
            ("gradcheck", lambda: check_gradcheck(_need(trace))),
            ("dead_units", lambda: check_dead_units(_need(trace))),
            ("overfit_one_batch", lambda: check_overfit(probe, overfit_steps)),
            ("heldout", lambda: check_heldout(probe))]
        if lr_range:
            steps.append(("lr_range", lambda: check_lr_range(probe, lr_plot)))
        checks = _run_in_order(steps)
    return _point_overfit_at_failures(checks)


def _point_overfit_at_failures(checks: list[Check]) -> list[Check]:
    """A failed Rule #1 names the earlier checks that failed: the checklist says look there first."""
    names = [c.name for c in checks if c.status == FAIL and c.name not in ("overfit_one_batch", "lr_range")]
    out = []
    for c in checks:
        if c.name == "overfit_one_batch" and c.status not in ("PASS", SKIP) and names:
            c = dataclasses.replace(c, evidence=c.evidence | {"look_first_at": names},
                                    fix=f"first fix the failed checks above ({', '.join(names)}); " + c.fix)
        out.append(c)
    return out


def _copyable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    try:
        model_copy, _ = copy_pair(model, optimizer)
    except Exception as exc:  # noqa: BLE001 - whatever the user's objects hold
        raise ValueError(f"preflight works on a copy, and copy.deepcopy of the model and optimizer failed "
                         f"({type(exc).__name__}: {exc}); keep locks, files and threads out of the model") from None
    # A __deepcopy__ that returns self (or shares parameters) would make every check train the
    # user's own model: refuse rather than break the promise that it is left unchanged.
    own = {id(p) for p in model.parameters()}
    if any(id(p) in own for p in model_copy.parameters()):
        raise ValueError("preflight works on a copy, and copy.deepcopy of the model returned one sharing "
                         "the model's parameters (a __deepcopy__ returning self?); make deepcopy copy them")


def _need(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


def check_recipe(recipe: Any, batches: Iterable[Any], **kwargs: Any) -> list[Check]:
    """:func:`check` for a :class:`sentineld.contracts.recipe.Recipe`: its step is ``train_step`` (clipping,
    autocast, its ``zero_grad`` flag) on the copies; scheduler and accumulation are left out."""
    from sentineld.contracts.recipe import train_step  # noqa: PLC0415

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        return train_step(dataclasses.replace(recipe, model=model, optimizer=optimizer, scheduler=None,
                                              scaler=None, accumulation_steps=1), batch)
    kwargs.setdefault("num_classes", recipe.num_classes)
    return check(recipe.model, recipe.optimizer, recipe.loss_fn, batches, step=step, **kwargs)


def check_lightning(module: torch.nn.Module, batches: Iterable[Any], optimizer: torch.optim.Optimizer | None = None,
                    **kwargs: Any) -> list[Check]:
    """:func:`check` for a LightningModule, on copies: the optimizer is ``configure_optimizers()``'s
    (default), the loss ``training_step(batch, batch_idx)`` (:func:`~sentineld.preflight.frameworks.derive`).

    Args:
        module: the LightningModule (``training_step`` and ``configure_optimizers`` are used).
        batches: an iterable of the batches ``training_step`` receives (the train DataLoader).
        optimizer: default: the one ``configure_optimizers()`` returns (one optimizer only).
        kwargs: :func:`check`'s keywords (split of one DataLoader batch, num_classes, overfit_steps, lr_range...).

    Raises:
        ValueError: ``configure_optimizers()`` returns several optimizers (manual optimization).
        TypeError: ``batches`` is not an iterable of batches.
    """
    return check(module, optimizer, None, batches, _framework="lightning", **kwargs)


def check_hf(model: torch.nn.Module, batches: Iterable[Any], optimizer: torch.optim.Optimizer | None = None,
             **kwargs: Any) -> list[Check]:
    """:func:`check` for a transformers model; loss ``model(**batch).loss``, on copies.

    Args:
        model: a ``PreTrainedModel`` (any module returning ``.loss`` from ``model(**batch)`` works).
        batches: dicts of model keyword arguments with ``"labels"`` (what the Trainer feeds).
        optimizer: default AdamW over every parameter with the Trainer's defaults
            (:data:`~sentineld.preflight.frameworks.HF_ADAMW`).
        kwargs: :func:`check`'s keywords.
    """
    return check(model, optimizer, None, batches, _framework="hf", **kwargs)
