"""Forward-only localization: for a run with neither ``loss_fn`` nor a recipe.

Without a loss function the replay cannot compute the loss, run backward or step the optimizer,
so it cannot re-execute steps S..N-1 either. What it can do: run the model's top-level forward
call of step N (its recorded arguments) on the snapshot's parameters, with the step's recorded
RNG state, under the same birth tracing as a full replay, and name the op and module where a
non-finite value was first made. The verdict says plainly what was not checked.

The parameters are those of snapshot S, not of step N: when S < N and the fault came from
parameters that went bad between S and N, the forward may come out finite here; the verdict then
says so and how to enable the full replay.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, cast

import torch
from torch.utils._pytree import tree_flatten

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import Finding, Replayed

from .localize import _forward, nonfinite_fields
from .trace import Tracer, nonfinite_flags, one_thread

__all__ = ["ForwardCall", "localize_forward", "HOW_TO_ENABLE", "NOT_CHECKED"]

#: What a forward-only verdict leaves unchecked.
NOT_CHECKED = ["loss", "backward", "optimizer step"]
#: How to get the full verdict.
HOW_TO_ENABLE = ("pass loss_fn=lambda model, batch: <loss> to sentineld.agent.attach (the "
                 "training process then replays loss, backward and optimizer step), or "
                 "recipe='module:function' (see sentineld.recipe)")


@dataclass
class ForwardCall:
    """The recorded top-level forward call of one step (host copies).

    Attributes:
        step: the step.
        args, kwargs: what the model's ``forward`` got.
        rng: RNG states at that forward (:func:`sentineld.contracts.rng.capture_rng`'s layout) or None.
    """

    step: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any] | None


class _Holder:
    """What :func:`replay.localize._forward` reads from a recipe: the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def _to(tree: Any, device: torch.device) -> Any:
    from sentineld.contracts.treecodec import map_tensors  # noqa: PLC0415

    return map_tensors(tree, lambda t: t.to(device))


def _run(model: torch.nn.Module, call: ForwardCall, set_rng: Callable[[dict[str, Any]], None],
         autocast_dtype: torch.dtype | None = None) -> tuple[Tracer, bool]:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = _to(call.args, device), _to(call.kwargs, device)
    if call.rng is not None:
        set_rng(dict(call.rng))
    tracer = Tracer(model)
    tracer.set_batch((args, kwargs))
    # The run's autocast: an fp16 overflow exists only under it.
    cast_ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    with tracer, cast_ctx:
        tracer.set_phase("forward")
        out = model(*args, **kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    with one_thread():
        nan, inf = nonfinite_flags([t.detach() for t in outs])
    return tracer, nan or inf


def localize_forward(model: torch.nn.Module, snapshot_step: int, calls: list[ForwardCall], first_step: int,
                     set_rng: Callable[[dict[str, Any]], None], *, autocast_dtype: torch.dtype | None = None,
                     recorded_losses: dict[int, float] | None = None) -> Replayed:
    """Run the recorded forward calls from ``first_step`` on ``model`` (holding snapshot S) until
    one makes a non-finite output; return what it found.

    Args:
        model: a copy of the model with the snapshot's state loaded, in the recorded modes.
        snapshot_step: S, whose parameters ``model`` holds.
        calls: recorded forward calls, one per step (steps before ``first_step`` are skipped).
        first_step: the incident's step N.
        set_rng: loads a recorded RNG state where the forward draws from (private generators in
            the training process).
        autocast_dtype: the autocast dtype the training forward ran under, or None.
        recorded_losses: step -> the loss the run recorded (sets ``recorded_nonfinite`` and says
            so when the forward is finite while the recorded loss was not).

    Returns:
        A :class:`Replayed` (``rank`` and ``capture`` left to the caller): phase ``data``
        (non-finite inputs), ``forward`` (op, module) or ``none``; ``reproduced`` is True when a
        non-finite output was made again. ``evidence`` holds ``checked``, ``not_checked`` and
        ``how_to_enable``.
    """
    t0 = time.perf_counter()
    todo = sorted((c for c in calls if c.step >= first_step), key=lambda c: c.step)
    found, reproduced = None, False
    tried = []
    step = first_step
    for call in todo:
        step = call.step
        fields = nonfinite_fields((call.args, call.kwargs), "forward_inputs")
        if fields:
            found = Finding(step=step, phase="data", cause="the model's forward got non-finite inputs",
                            cause_class="data_nonfinite", where=f"forward inputs, {fields[0]['field']}",
                            fix="check the data pipeline for the samples named (NaN/Inf in the input)",
                            evidence={"field": fields[0]["field"], "samples": fields[0]["samples"], "fields": fields})
            reproduced = True
            break
        tracer, bad = _run(model, call, set_rng, autocast_dtype)
        tried.append(call.step)
        if bad:
            found = _forward(step, {"births": [b.summary() for b in tracer.births[:5]]},
                             cast(Recipe, _Holder(model)), tracer)  # _forward reads .model only
            reproduced = True
            break
    if found is None:
        found = Finding(step=step, phase="none", cause_class="not_checked", fix=HOW_TO_ENABLE,
                        cause=(f"the model's forward of steps {tried or [first_step]} is finite on snapshot "
                               f"{snapshot_step}'s parameters: the non-finite value was made in the loss, "
                               "backward or optimizer step, or by parameters changed since the snapshot"))
    not_checked = list(NOT_CHECKED)
    if step > snapshot_step:
        not_checked.append(f"parameter updates of steps {snapshot_step}..{step - 1} "
                           f"(the forward ran on snapshot {snapshot_step}'s parameters)")
    rec = (recorded_losses or {}).get(step)
    recorded_nonfinite = rec is not None and not math.isfinite(rec)
    if found.phase == "none" and recorded_nonfinite:
        found = replace(found, cause=f"the run recorded loss {rec!r} at step {step}, but {found.cause}")
    ev = dict(mode="forward_only", checked=["forward"], not_checked=not_checked, how_to_enable=HOW_TO_ENABLE,
              snapshot_step=snapshot_step, forward_steps_tried=tried, replayed_loss=math.nan,
              autocast_dtype=str(autocast_dtype).removeprefix("torch.") if autocast_dtype is not None else None,
              warning=(f"forward-only verdict: the loss, backward and optimizer step were not checked; to "
                       f"check them, {HOW_TO_ENABLE}"))
    elapsed = round(time.perf_counter() - t0, 4)
    return Replayed(found, requested_step=first_step, reproduced=reproduced, steps_rebuilt=0, elapsed_s=elapsed,
                    localize_s=elapsed, recorded_nonfinite=recorded_nonfinite, evidence=ev)
