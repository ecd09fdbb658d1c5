"""Checks 5, 6 and 8: gradients flow, gradients are applied (and zeroed), custom backwards are right.

The method: "compare param.grad before and after loss.backward(); check if you forgot
optimizer.step() / zero_grad()"; gradcheck "in double precision, single sample or very small
batch", reserved for custom layers and self-implemented backward passes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from .context import Probe
from .result import FAIL, PASS, WARN, Check
from .trace import Trace

__all__ = ["check_gradient_flow", "check_gradients_applied", "check_gradcheck", "ZERO_GRAD_TOL"]

#: Relative distance under which the second step's gradient "is" fresh or accumulated.
ZERO_GRAD_TOL = 1e-3
#: gradcheck runs on at most this many samples of a custom Function's batch.
GRADCHECK_SAMPLES = 2
#: An input with more elements than this is checked at SUBSET_ELEMENTS random elements: the
#: numerical Jacobian costs two forwards per checked element (and torch's fast mode, on failure,
#: reruns the full slow check to word its message).
FULL_NUMEL = 1024
SUBSET_ELEMENTS = 64


def _names(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def check_gradient_flow(probe: Probe) -> Check:
    """After one backward every trainable parameter has a finite, non-zero gradient and is in the
    optimizer; frozen parameters handed to the optimizer were likely meant to be trained."""
    model, opt = probe.fresh()
    model.zero_grad(set_to_none=True)
    called = _called_modules(model, lambda: probe.loss_fn(model, probe.batch).backward())
    owner = {id(p): mod for mod in model.modules() for p in mod.parameters(recurse=False)}
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    found: dict[str, list[str]] = {"no_grad": [], "non_finite": [], "zero": [], "not_in_optimizer": [],
                                   "frozen_in_optimizer": [], "frozen": [], "unused_module": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            found["frozen_in_optimizer" if id(p) in in_opt else "frozen"].append(name)
            continue
        if id(p) not in in_opt:
            found["not_in_optimizer"].append(name)
        if p.grad is None:
            # a module the forward never called (an unused pooler or head) is dead weight, not a
            # broken graph; a called module whose parameter gets no gradient was detached
            found["unused_module" if id(owner.get(id(p))) not in called else "no_grad"].append(name)
        elif not torch.isfinite(p.grad).all():
            found["non_finite"].append(name)
        elif not p.grad.any():
            found["zero"].append(name)
    ev: dict[str, Any] = {k: v for k, v in found.items() if v}
    problems = [(k, v) for k, v in found.items() if v and k not in ("frozen", "unused_module")]
    if problems:
        text = {"no_grad": "get no gradient (not on the loss's graph: detached, unused or under no_grad)",
                "non_finite": "get a NaN/Inf gradient", "zero": "get an all-zero gradient",
                "not_in_optimizer": "are trainable but not in the optimizer (never updated)",
                "frozen_in_optimizer": "are frozen (requires_grad=False) but handed to the optimizer: "
                                       "likely meant to be trained"}
        msg = "; ".join(f"{len(v)} parameters {text[k]}: {_names(v)}" for k, v in problems)
        return Check("gradient_flow", FAIL, msg, ev,
                     "for name, p in model.named_parameters(): print(name, p.grad is not None and "
                     "p.grad.abs().max() > 0); build the optimizer from model.parameters() after "
                     "deciding what to freeze; look for .detach(), no_grad and dead units upstream")
    n = sum(1 for p in model.parameters() if p.requires_grad)
    if found["unused_module"]:
        return Check("gradient_flow", WARN, f"{len(found['unused_module'])} parameters belong to modules the "
                     f"forward never called: {_names(found['unused_module'])}", ev,
                     "remove the unused modules, or call them if they were meant to be used")
    if found["frozen"]:
        return Check("gradient_flow", WARN, f"{n} trainable parameters get finite non-zero gradients; "
                     f"{len(found['frozen'])} are frozen: {_names(found['frozen'])}", ev,
                     "check that freezing these is intended")
    return Check("gradient_flow", PASS, f"all {n} trainable parameters get finite, non-zero gradients "
                 "and are in the optimizer", ev)


def _called_modules(model: torch.nn.Module, run: Callable[[], None]) -> set[int]:
    """ids of the modules whose forward ran during ``run()``."""
    called: set[int] = set()
    handles = [m.register_forward_pre_hook(lambda mod, _inp: called.add(id(mod))) for m in model.modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return called


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    gs = [p.grad.detach().reshape(-1).double() for p in model.parameters() if p.grad is not None]
    return torch.cat(gs) if gs else torch.zeros(0, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_gradients_applied(probe: Probe) -> Check:
    """One step changes the parameters that got gradients; the next step starts from zeroed grads.

    The zeroing test: after step 1 the gradient of step 2 is compared with a fresh gradient at
    the same parameters (same batch, same RNG seed): equal means zeroed, equal to step 1's plus
    the fresh one means accumulated across steps (``ZERO_GRAD_TOL`` relative).
    """
    model, opt = probe.fresh()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    probe.step(model, opt, probe.batch)
    g1 = _flat_grads(model)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    stuck = [n for n, p in model.named_parameters()
             if id(p) in in_opt and p.grad is not None and p.grad.any() and torch.equal(p.detach(), before[n])]
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    ev: dict[str, Any] = {"changed": len(moved), "parameters": len(before), "unchanged_with_grad": stuck[:20]}
    if not moved:
        return Check("gradients_applied", FAIL, "no parameter changed after one optimizer step", ev,
                     "check the four-step loop: zero_grad, forward, backward, optimizer.step(); "
                     "a learning rate of 0 does this too")
    if stuck:
        return Check("gradients_applied", FAIL, f"{len(stuck)} parameters have a gradient and are in the "
                     f"optimizer but did not change: {_names(stuck)}", ev,
                     "check their param group's lr and that optimizer.step() runs")
    fresh = copy.deepcopy(model)
    fresh.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    probe.loss_fn(fresh, probe.batch).backward()
    g_fresh = _flat_grads(fresh)
    torch.manual_seed(1)
    probe.step(model, opt, probe.batch)
    g2 = _flat_grads(model)
    if g2.shape == g_fresh.shape == g1.shape and g_fresh.norm() > 0:
        err_fresh, err_acc = _rel(g2, g_fresh), _rel(g2, g1 + g_fresh)
        ev |= {"rel_err_vs_fresh_grad": err_fresh, "rel_err_vs_accumulated": err_acc}
        if err_acc < ZERO_GRAD_TOL < err_fresh:
            return Check("gradients_applied", FAIL, "gradients accumulate across steps: step 2's gradient "
                         "is step 1's plus the new one", ev, "call optimizer.zero_grad() before every batch")
    return Check("gradients_applied", PASS, f"{len(moved)}/{len(before)} parameters changed after one "
                 "step; gradients are zeroed between steps", ev)


def _double_inputs(args: tuple[Any, ...]) -> tuple[list[Any], list[int]]:
    """Arguments in float64 (requires_grad), batch-like tensors cut to GRADCHECK_SAMPLES rows."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    batch = first.shape[0] if first is not None else None
    out, diff = [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            t = a.detach()
            if batch and t.dim() > 0 and t.shape[0] == batch and batch > GRADCHECK_SAMPLES:
                t = t[:GRADCHECK_SAMPLES]
            out.append(t.double().clone().requires_grad_(True))
            diff.append(i)
        else:
            out.append(a)
    return out, diff


def _on_subsets(fn: Callable[..., Any], xs: list[torch.Tensor]
                ) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """``fn`` as a function of a few elements of each big input (``base + scatter(delta)``).

    Returns:
        ``(g, deltas)``: ``g(*deltas)`` calls ``fn`` with every input rebuilt; a small input is
        its own delta, a big one gets a zero delta of SUBSET_ELEMENTS at seeded random positions.
    """
    gen = torch.Generator().manual_seed(0)
    plan: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for x in xs:
        if x.numel() <= FULL_NUMEL:
            plan.append((None, x))
        else:
            idx = torch.randperm(x.numel(), generator=gen)[:SUBSET_ELEMENTS]
            plan.append((idx, torch.zeros(SUBSET_ELEMENTS, dtype=x.dtype, requires_grad=True)))

    def g(*deltas: torch.Tensor) -> Any:
        full = [d if idx is None else x.detach().reshape(-1).index_add(0, idx, d).view_as(x)
                for (idx, _), d, x in zip(plan, deltas, xs)]
        return fn(*full)
    return g, tuple(d for _, d in plan)


def check_gradcheck(trace: Trace) -> Check:
    """``torch.autograd.gradcheck`` in float64 for every custom autograd Function the trace met."""
    if not trace.functions:
        return Check("gradcheck", PASS, "no custom autograd Function in the forward (stock ops are "
                     "verified by PyTorch)", {"functions": []})
    results: dict[str, str] = {}
    for cls, (args, kwargs) in trace.functions.items():
        name = f"{cls.__module__}.{cls.__qualname__}"
        inputs, diff = _double_inputs(args)

        def fn(*xs: torch.Tensor, _cls: Any = cls, _inputs: list[Any] = inputs, _diff: list[int] = diff,
               _kwargs: dict[str, Any] = kwargs) -> Any:
            full = list(_inputs)
            for i, x in zip(_diff, xs):
                full[i] = x
            return _cls.apply(*full, **_kwargs)
        probe_fn, xs = _on_subsets(fn, [inputs[i] for i in diff])
        try:
            ok = torch.autograd.gradcheck(probe_fn, xs, eps=1e-6, atol=1e-4, raise_exception=True)
            results[name] = "ok" if ok else "mismatch"
        except Exception as exc:  # noqa: BLE001 - GradcheckError and whatever the Function raises
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    bad = {k: v for k, v in results.items() if v != "ok"}
    ev = {"functions": results}
    if bad:
        return Check("gradcheck", FAIL, f"gradcheck fails for {_names(list(bad))}: the hand-written "
                     "backward disagrees with numerical differences", ev,
                     "fix the backward of these Functions (test with torch.autograd.gradcheck in double)")
    return Check("gradcheck", PASS, f"gradcheck passes for {len(results)} custom Function(s)", ev)
