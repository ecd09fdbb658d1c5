"""Run one rebuilt step instrumented and name where its first non-finite value was made.

The verdict follows the step's order and stops at the first phase that went wrong:

- ``data``: the batch (any micro-batch) holds NaN/Inf: which field, which samples (dim 0).
- ``forward``: a micro-batch's loss is non-finite. The culprit is the first op *birth*
  (``replay.trace``) whose module call let the non-finite value out (a birth masked inside its
  module, e.g. ``where(x > 0, log(x), 0)``, does not count); its innermost module is named, or
  ``module`` null and ``where`` saying so when the op ran outside the model (a hand-written or
  functional loss).
- ``backward``: the loss is finite but a gradient is not: the first birth in backward whose values
  were not masked (``replay.masking``), traced to its earliest ancestor; its module (the module
  whose forward created the autograd node, or the owner of the parameter for ``AccumulateGrad``),
  the forward op whose derivative made it as ``op`` (the derivative's primitive, the node, a
  custom Function and whether torch.where took the output in evidence), and the parameters whose
  gradients went non-finite. Without a birth in backward, a masked forward birth (``where(x > 0,
  sqrt(x), 0)`` at x < 0) is the origin.
- ``optimizer``: gradients finite (or Inf turned into NaN by clipping, which counts here), but
  parameters or optimizer state are non-finite after the step, or the learning rate is
  non-finite (``module`` null, ``where`` names the optimizer step, ``optimizer step (Adam)``, or the
  scheduler; the modules owning the parameters are in evidence). Names the parameters, the state entry (e.g. a zero
  ``exp_avg_sq`` with an eps that is 0 in float16) and the op.
- ``none``: every value finite (a GradScaler-skipped step with Inf gradients counts as finite).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import OUTSIDE_MODEL, Finding

from .causes import Facts, likely_cause
from .rebuild import run_step
from .trace import Birth, Tracer, is_finite, nonfinite_flags, one_thread, tensor_stats

__all__ = ["localize", "nonfinite_fields"]


def nonfinite_fields(batch: Any, path: str = "batch") -> list[dict[str, Any]]:
    """Fields of ``batch`` holding NaN/Inf, with the sample indices (dim 0) affected.

    Returns a list of ``{"field": "batch[0]", "samples": [3, 11], "count": 2, "stats": {...}}``.
    """
    found: list[dict[str, Any]] = []
    if isinstance(batch, torch.Tensor):
        if not is_finite(batch):
            bad = ~torch.isfinite(batch)
            rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist() if batch.dim() else []
            found.append({"field": path, "samples": rows[:64], "count": int(bad.sum()),
                          "stats": tensor_stats(batch)})
    elif isinstance(batch, dict):
        for k, v in batch.items():
            found += nonfinite_fields(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            found += nonfinite_fields(v, f"{path}[{i}]")
    return found


def _namer(recipe: Recipe) -> dict[int, str]:
    """``data_ptr -> name`` for parameters, their gradients and optimizer state, as they are now."""
    names: dict[int, str] = {}
    for n, p in recipe.model.named_parameters():
        names[p.data_ptr()] = n
        if p.grad is not None:
            names[p.grad.data_ptr()] = f"{n}.grad"
        for k, v in recipe.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                names[v.data_ptr()] = f"{n}:{k}"
    return names


def _grad_flags(recipe: Recipe) -> dict[str, tuple[bool, bool]]:
    out = {}
    for n, p in recipe.model.named_parameters():
        if p.grad is not None:
            out[n] = nonfinite_flags([p.grad.detach()])
    return out


def _lr(recipe: Recipe) -> float | None:
    g = recipe.optimizer.param_groups
    return float(g[0]["lr"]) if g and "lr" in g[0] else None


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def localize(recipe: Recipe, step: int, batch: Any, rng: Any, record: dict[str, Any] | None) -> Finding:
    """Run ``step`` on ``recipe`` (holding the state before it) under the tracer; return what it found.

    The step runs in full (the state after it is the state before ``step + 1``). ``record`` is the
    agent's record of the step (``loss``, ``grad_norm``, ``lr``) or None.
    """
    record = record or {}
    tracer = Tracer(recipe.model, lambda: _namer(recipe))
    tracer.set_batch(batch[0] if recipe.accumulation_steps > 1 and isinstance(batch, (list, tuple)) and batch
                     else batch)
    seen: dict[str, Any] = {"micro_losses": [], "stepped": False}

    def on_phase(phase: str) -> None:
        with tracer.pause():
            _on_phase(phase)
        tracer.set_phase(phase)

    def _on_phase(phase: str) -> None:
        if phase in ("clip", "optimizer") and "grads_pre" not in seen:
            seen["grads_pre"] = flags = _grad_flags(recipe)
            nan = any(f[0] for f in flags.values())
            inf = any(f[1] for f in flags.values())
            if nan or (inf and phase == "optimizer"):
                tracer.active = False  # a backward verdict: nothing after it can change it
        if phase == "optimizer":
            if recipe.clip_grad_norm is not None and any(any(f) for f in seen["grads_pre"].values()):
                tracer.active = False  # clip verdict or backward verdict
            seen["lr"] = _lr(recipe)

    loss_fn = recipe.loss_fn

    def traced_loss(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        out = loss_fn(model, mb)
        with tracer.pause():
            value = float(out.detach().float()) if out.numel() == 1 else math.nan
        seen["micro_losses"].append(value)
        if not math.isfinite(value):
            tracer.active = False  # a forward verdict: the rest of the step runs untraced
        return out

    hook = recipe.optimizer.register_step_pre_hook(lambda *a: seen.__setitem__("stepped", True))
    recipe.loss_fn = traced_loss
    try:
        with tracer:
            seen["loss"] = run_step(recipe, batch, rng, on_phase=on_phase)
    finally:
        recipe.loss_fn = loss_fn
        hook.remove()
    with one_thread():
        return _verdict(step, recipe, tracer, seen, batch, record)


def _verdict(step: int, recipe: Recipe, tracer: Tracer, seen: dict[str, Any], batch: Any,
             record: dict[str, Any]) -> Finding:
    """The first phase that went wrong, in the step's order (the module docstring)."""
    loss = seen["loss"]
    fields = nonfinite_fields(batch)
    lr_after = _lr(recipe)
    grads_pre: dict[str, tuple[bool, bool]] = seen.get("grads_pre", {})
    bad_grads = [n for n, (nan, inf) in grads_pre.items() if nan or inf]
    skipped = recipe.scaler is not None and not seen["stepped"]
    bad_params = [n for n, p in recipe.model.named_parameters() if not is_finite(p.detach())]
    ev = dict(replayed_loss=loss, recorded_loss=record.get("loss"), micro_losses=seen["micro_losses"],
              recorded_grad_norm=record.get("grad_norm"), recorded_lr=record.get("lr"),
              lr=seen.get("lr"), lr_after=lr_after, optimizer_skipped=skipped,
              ops_observed=tracer.op_count, births=[b.summary() for b in tracer.births[:5]])
    lr_used = seen.get("lr")
    if fields:
        return _data(step, ev, fields)
    if any(not math.isfinite(x) for x in seen["micro_losses"]):
        return _forward(step, ev, recipe, tracer)
    if bad_grads and not skipped:
        inf_only = not any(grads_pre[n][0] for n in bad_grads)
        clip_nan = next((b for b in tracer.births if b.phase == "clip" and b.kind == "nan"), None)
        if recipe.clip_grad_norm is not None and inf_only and clip_nan is not None:
            return _clip(step, ev, recipe, tracer, clip_nan, bad_grads)
        return _backward(step, ev, recipe, tracer, bad_grads)
    if not _finite(lr_used):
        return _scheduler(step, ev, recipe, lr_used, lr_after, bad_params)
    bad_state = _bad_state(recipe)
    if bad_params or bad_state:
        return _optimizer(step, ev, recipe, tracer, bad_params, bad_state)
    if not _finite(lr_after):
        return _scheduler(step, ev, recipe, lr_used, lr_after, bad_params)
    return _none(step, ev, record, skipped)


def _found(step: int, phase: str, evidence: dict[str, Any], facts: Facts, **fields: Any) -> Finding:
    """The finding of ``phase``, with its likely cause and fix from ``facts`` (the NaN table)."""
    c = likely_cause(facts)
    return Finding(step=step, phase=phase, cause_class=c.cls, cause=c.cause, fix=c.fix,
                   evidence={**evidence, "nan_table_row": c.row}, **fields)


def _place(module: str | None, mtype: str | None) -> dict[str, Any]:
    """``module`` / ``module_type`` / ``where`` from a tracer's module name (``<Type>`` or None:
    outside the model)."""
    if module is None or module.startswith("<"):
        mt = module.strip("<>") if module else None
        return {"module": None, "module_type": mt,
                "where": f"loss module {mt}, outside the model" if module else OUTSIDE_MODEL}
    return {"module": module, "module_type": mtype,
            "where": f"module '{module}' ({mtype})" if module else f"the model's own forward ({mtype})"}


def _data(step: int, ev: dict[str, Any], fields: list[dict[str, Any]]) -> Finding:
    return _found(step, "data", {**ev, "field": fields[0]["field"], "samples": fields[0]["samples"],
                                 "fields": fields}, Facts("data"), where=f"input batch, {fields[0]['field']}")


def _propagates(b: Birth, tracer: Tracer) -> bool:
    """The birth's innermost module call let a non-finite value out (ops outside modules do)."""
    if b.call is None:
        return True
    c = tracer.calls[b.call]
    return c.out_nan or c.out_inf


def _module_params(recipe: Recipe, module: str | None) -> list[str]:
    for mname, m in recipe.model.named_modules():
        if mname == module:
            return [f"{mname}.{pn}" if mname else pn for pn, _ in m.named_parameters(recurse=False)]
    return []


def _forward(step: int, ev: dict[str, Any], recipe: Recipe, tracer: Tracer) -> Finding:
    ev = dict(ev)
    first_call = next((c for c in tracer.calls if c.born_here), None)
    if first_call is not None:
        ev["first_nonfinite_module"] = {
            "module": first_call.name, "module_type": first_call.module_type,
            "micro_batch": first_call.micro, **first_call.stats()}
    b = next((b for b in tracer.births if b.phase == "forward" and _propagates(b, tracer)), None)
    if b is None:
        # Non-finite without a birth: the rebuilt state already held it.
        place = _place(first_call.name if first_call else None, first_call.module_type if first_call else None)
        if first_call is None:
            place["where"] = "the rebuilt state (parameters, buffers)"
        return Finding(step=step, phase="forward", cause_class="state_nonfinite",
                       cause="non-finite values were already in the rebuilt state",
                       fix="replay an earlier step (--step) to find where they were made", evidence=ev, **place)
    ev.update(op_inputs=b.inputs, op_output=b.output, micro_batch=b.micro, kind=b.kind, samples=b.samples)
    if b.call is not None:
        ev["module_call"] = tracer.calls[b.call].stats()
    return _found(step, "forward", ev, Facts("forward", b.op, b.kind, b.inputs, b.output), op=b.op,
                  parameters=_module_params(recipe, b.module), **_place(b.module, b.module_type))


def _backward_birth(tracer: Tracer) -> Birth | None:
    """The first backward birth not masked later, traced back to its earliest backward ancestor."""
    births = [b for b in tracer.births if b.phase == "backward"]
    b = next((b for b in births if not b.masked), births[0] if births else None)
    if b is not None and tracer.births[b.root].phase == "backward":
        b = tracer.births[b.root]
    return b


def _backward(step: int, ev: dict[str, Any], recipe: Recipe, tracer: Tracer, bad_grads: list[str]) -> Finding:
    b = _backward_birth(tracer)
    masked_fwd = None
    if b is None:
        masked_fwd = next((m for m in tracer.births if m.phase == "forward" and not _propagates(m, tracer)), None)
    if masked_fwd is not None:
        # The forward made NaN/Inf in elements a selector dropped; backward multiplies through them.
        m = masked_fwd
        return _found(step, "backward", {**ev, "op_inputs": m.inputs, "op_output": m.output, "kind": m.kind,
                                         "micro_batch": m.micro, "masked_forward_birth": m.summary(),
                                         "samples": m.samples},
                      Facts("backward", m.op, m.kind, m.inputs, m.output, forward_op=m.op, masked_forward=True),
                      op=m.op, parameters=bad_grads, **_place(m.module, m.module_type))
    if b is None:
        return Finding(step=step, phase="backward", parameters=bad_grads, cause_class="no_birth",
                       cause="gradients were non-finite without a birth in backward",
                       fix="check gradient hooks or custom autograd Functions that write gradients", evidence=ev)
    return _found(step, "backward", {**ev, "op_inputs": b.inputs, "op_output": b.output, "micro_batch": b.micro,
                                     "kind": b.kind, "primitive": b.op, "forward_op": b.forward_op,
                                     "custom_function": b.custom_function, "where_branch": b.where_branch,
                                     "samples": b.samples},
                  Facts("backward", b.op, b.kind, b.inputs, b.output, node=b.autograd_node,
                        forward_op=b.forward_op, custom_function=b.custom_function,
                        where_branch=b.where_branch, zero_grad=recipe.zero_grad),
                  op=b.forward_op or b.op, autograd_node=b.autograd_node, parameters=bad_grads,
                  **_place(b.module, b.module_type))


def _owner(recipe: Recipe, pname: str) -> tuple[str | None, str | None]:
    mname = pname.rpartition(".")[0]
    for n, m in recipe.model.named_modules():
        if n == mname:
            return n, type(m).__name__
    return None, None


def _clip(step: int, ev: dict[str, Any], recipe: Recipe, tracer: Tracer, clip_nan: Birth,
          inf_grads: list[str]) -> Finding:
    place = {**_place(*_owner(recipe, inf_grads[0])),
             "where": f"gradient clipping (clip_grad_norm_ {recipe.clip_grad_norm:g})"}
    origin = _backward_birth(tracer)
    return _found(step, "optimizer", {**ev, "op_inputs": clip_nan.inputs, "op_output": clip_nan.output,
                                      "clip_grad_norm": recipe.clip_grad_norm,
                                      "inf_gradient_origin": origin.summary() if origin else None},
                  Facts("optimizer", clip_nan.op, "nan", clip_nan.inputs, clip_nan.output, clip=True),
                  op=clip_nan.op, parameters=inf_grads, **place)


def _scheduler(step: int, ev: dict[str, Any], recipe: Recipe, lr: float | None, lr_after: float | None,
               bad_params: list[str]) -> Finding:
    sched = recipe.scheduler
    mtype = type(sched).__name__ if sched is not None else None
    scheduler = {"type": mtype, "last_epoch": getattr(sched, "last_epoch", None),
                 "lr_used_by_step": lr, "lr_set_for_next_step": lr_after,
                 "base_lrs": list(getattr(sched, "base_lrs", []) or [])}
    return _found(step, "optimizer", {**ev, "scheduler": scheduler}, Facts("optimizer", lr=lr, lr_after=lr_after),
                  module=None, op="lr", module_type=mtype, where=f"learning-rate scheduler ({mtype or 'none'})",
                  parameters=bad_params)


def _bad_state(recipe: Recipe) -> list[tuple[str, str]]:
    out = []
    for n, p in recipe.model.named_parameters():
        for k, v in recipe.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and not is_finite(v):
                out.append((n, k))
    return out


def _optimizer(step: int, ev: dict[str, Any], recipe: Recipe, tracer: Tracer, bad_params: list[str],
               bad_state: list[tuple[str, str]]) -> Finding:
    ev = dict(ev)
    b = next((b for b in tracer.births if b.phase == "optimizer"), None)
    named = [t.partition(":")[0] for t in (b.tensor_names if b else []) if not t.endswith(".grad")]
    params = list(dict.fromkeys([n for n in named if n in dict(recipe.model.named_parameters())]
                                + bad_params + [n for n, _ in bad_state]))
    # The culprit is the optimizer's arithmetic, not the module owning the parameter: naming that
    # module sent users into the model's code. The owners stay in evidence.
    ev["parameter_modules"] = list(dict.fromkeys(m for m in (_owner(recipe, n)[0] for n in params[:16])
                                                 if m is not None))
    eps_lost, state_ev = False, []
    pmap = dict(recipe.model.named_parameters())
    group_of = {id(p): g for g in recipe.optimizer.param_groups for p in g["params"]}
    for name in params[:4]:
        p = pmap[name]
        bad = ~torch.isfinite(p.detach())
        for k, v in recipe.optimizer.state.get(p, {}).items():
            if not (isinstance(v, torch.Tensor) and v.shape == p.shape and v.is_floating_point()):
                continue
            zero_at_bad = int(((v == 0) & bad).sum())
            nonfinite = int((~torch.isfinite(v)).sum())
            if zero_at_bad or nonfinite:
                state_ev.append({"parameter": name, "entry": k, "zeros_where_param_nonfinite": zero_at_bad,
                                 "nonfinite": nonfinite, "stats": tensor_stats(v)})
        eps = group_of.get(id(p), {}).get("eps")
        if isinstance(eps, float) and eps > 0:
            eps_dtype = float(torch.tensor(eps, dtype=p.dtype))
            ev.setdefault("eps", {"eps": eps, "in_param_dtype": eps_dtype,
                                  "param_dtype": str(p.dtype).removeprefix("torch.")})
            eps_lost = eps_lost or eps_dtype == 0.0
    entry = _state_culprit(state_ev)
    ev.update(state_entry=entry, optimizer_state=state_ev, optimizer=type(recipe.optimizer).__name__)
    if b is not None:
        ev.update(op_inputs=b.inputs, op_output=b.output, tensors=b.tensor_names, kind=b.kind)
    return _found(step, "optimizer", ev, Facts("optimizer", b.op if b else None, b.kind if b else None,
                                               b.inputs if b else [], b.output if b else {},
                                               eps_lost=eps_lost and entry is not None, state_entry=entry),
                  module=None, module_type=type(recipe.optimizer).__name__,
                  where=f"optimizer step ({type(recipe.optimizer).__name__})",
                  op=b.op if b else None, parameters=params)


_DENOMINATOR_HINTS = ("sq", "square", "var", "denom", "hess", "second")


def _state_culprit(state_ev: list[dict[str, Any]]) -> str | None:
    """The state entry at fault: a non-finite one, else one that is 0 where the parameter went
    non-finite, preferring second-moment-like names (a zero denominator, not a zero numerator)."""
    if not state_ev:
        return None
    nonfinite = [e for e in state_ev if e["nonfinite"]]
    if nonfinite:
        return str(nonfinite[0]["entry"])
    denom = [e for e in state_ev if any(h in str(e["entry"]).lower() for h in _DENOMINATOR_HINTS)]
    return str((denom or state_ev)[0]["entry"])


def _none(step: int, ev: dict[str, Any], record: dict[str, Any], skipped: bool) -> Finding:
    rec_bad = any(isinstance(record.get(k), float) and not math.isfinite(record[k])
                  for k in ("loss", "grad_norm", "lr"))
    ev = {**ev, "recorded_nonfinite": rec_bad}
    if skipped:
        ev["note"] = "GradScaler skipped the optimizer step (Inf/NaN gradients, as designed)"
    return _found(step, "none", ev, Facts("none", recorded_nonfinite=rec_bad))
