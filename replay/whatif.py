"""What-if replay: candidate fixes derived from a verdict, each checked on a fresh copy of the
captured state over the offending step and the captured steps after it (issue 25).

Candidates (each one :class:`replay.counterfactual.Change`, only where it applies):

- an eps or a clamp at the culprit op, inside the culprit module (``replay.opguard``);
- a ``log1p`` / ``softplus`` / ``logsigmoid`` / ``log_softmax`` rewrite of a culprit ``log``
  whose input came from ``1 + x``, ``1 + exp``, ``sigmoid`` or ``softmax``;
- the culprit module in float32 with autocast off (a run under autocast, or half parameters);
- the offending samples dropped (the verdict's ``samples``, or a data verdict's field samples);
- the learning rate x0.1;
- gradient clipping at the run's p99 grad norm (its recorded, finite, pre-fault grad norms);
- the optimizer's eps raised (1e-6 for float32 parameters, 1e-4 for half ones).

A row: ``{"change", "finite", "steps_checked", "loss", "loss_distance", "wall_s"}`` (+ ``error``
when the user's code raised under the change; for an op guard ``applied``, the call sites it
changed, ``op_calls``, the op's calls where it looked, and for a rewrite ``rewritten_as``).
``loss`` is the last checked step's, ``loss_distance`` the mean |loss - recorded| over the
checked steps (a non-finite recorded loss counts as the last finite one before the fault).
Ranked finite first, then least change. A candidate that stays finite for k steps is evidence,
not proof: the steps after the ring's end were never run.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from sentineld.contracts.verdict import Finding

from .counterfactual import Change, Engine, Outcome
from .opguard import GUARDABLE, REWRITABLE, OpGuard, base_name

__all__ = ["candidates", "what_if", "EVIDENCE_NOT_PROOF", "p99"]

#: Said with every what-if table (README, the notification).
EVIDENCE_NOT_PROOF = ("a candidate that stays finite for the checked steps is evidence, not proof: "
                      "the steps after the capture were never run with it")


def p99(values: list[float]) -> float | None:
    """The 99th percentile (nearest rank) of the finite ``values`` at most 10x their median (a
    diverging stretch before the fault is not the run's usual norm), or None."""
    v = sorted(x for x in values if math.isfinite(x))
    if v:
        med = v[len(v) // 2]
        v = [x for x in v if x <= 10 * med] or v
    if not v:
        return None
    return v[min(len(v) - 1, max(0, math.ceil(0.99 * len(v)) - 1))]


def _half(engine: Engine) -> bool:
    rec = engine.recipe_info()
    return rec.autocast_dtype in (torch.float16, torch.bfloat16) or any(
        p.dtype in (torch.float16, torch.bfloat16) for p in rec.model.parameters())


def candidates(report: Finding, engine: Engine, grad_norms: list[float] | None = None) -> list[Change]:
    """The candidate changes for ``report``'s verdict (module docstring)."""
    out: list[Change] = []
    op = base_name(report.op) if report.op not in (None, "lr", "exp_avg_sq", "grad_norm") else None
    culprit_phase = report.phase in ("forward", "backward")
    module = report.module
    where = f" in {module}" if module else (" in the model" if module == "" else "")
    if op and culprit_phase and op in GUARDABLE:
        mode = "clamp" if op in ("acos", "asin", "atanh", "exp", "expm1") else "eps"
        out.append(Change(f"{mode} at {report.op}{where}", guard=OpGuard(op, module, mode)))
    if op and culprit_phase and op in REWRITABLE:
        out.append(Change(f"stable rewrite of {report.op}{where}",  # which one: the row's rewritten_as
                          guard=OpGuard(op, module, "rewrite")))
    rec = engine.recipe_info()
    if module is not None and (rec.autocast_dtype is not None or _half(engine)):
        out.append(Change(f"{module or 'the model'} in float32, autocast off", fp32_module=module))
    samples = list(report.samples or report.evidence.get("samples") or [])
    if samples:
        out.append(Change(f"samples {samples[:8]} dropped", drop_samples=tuple(int(s) for s in samples)))
    out.append(Change("lr x0.1", lr_scale=0.1))
    clip = p99(grad_norms or [])
    if clip is not None and clip > 0:
        out.append(Change(f"clip grad norm at {clip:.4g} (the run's p99)", clip_norm=clip))
    eps = [float(g["eps"]) for g in rec.optimizer.param_groups if isinstance(g.get("eps"), float)]
    if eps:
        target = 1e-4 if _half(engine) else 1e-6
        if max(eps) < target:
            out.append(Change(f"optimizer eps {max(eps):g} -> {target:g}", optimizer_eps=target))
    return out


def _reference(engine: Engine, start: int) -> dict[int, float]:
    """Recorded loss per captured step from ``start``; a non-finite one is the last finite before."""
    last = next((engine.recorded[s] for s in sorted(engine.recorded, reverse=True)
                 if s < start and math.isfinite(engine.recorded[s])), math.nan)
    ref = {}
    for s in engine.steps:
        if s >= start:
            v = engine.recorded.get(s, math.nan)
            if math.isfinite(v):
                last = v
            ref[s] = v if math.isfinite(v) else last
    return ref


def _row(o: Outcome, ref: dict[int, float]) -> dict[str, Any]:
    dists = [abs(v - ref[s]) for s, v in o.losses.items() if math.isfinite(v) and math.isfinite(ref.get(s, math.nan))]
    row: dict[str, Any] = {"change": o.change.label, "finite": o.finite and o.error is None,
                           "steps_checked": o.steps_checked, "loss": o.last_loss,
                           "loss_distance": (sum(dists) / len(dists)) if dists and o.finite else None,
                           "losses": {str(s): v for s, v in sorted(o.losses.items())}, "wall_s": o.wall_s}
    if o.error:
        row["error"] = o.error
    if o.guard_applied is not None:
        # applied 0 with op_calls > 0: the op ran there and the guard could not change it (a
        # log whose input no sigmoid/softmax/1+x made): not "the op never ran there".
        row["applied"], row["op_calls"] = o.guard_applied, o.guard_calls
        if o.guard_rewrites:
            row["rewritten_as"] = list(o.guard_rewrites)
    return row


def what_if(engine: Engine, report: Finding, start: int, grad_norms: list[float] | None = None,
            spike_bar: float | None = None, spike_step: int | None = None
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every candidate from ``start`` over the captured steps after it.

    Args:
        spike_bar: for a spike verdict, the loss above which step ``spike_step`` (default
            ``start``; a state verdict starts at the step that made the state) still spikes:
            rows then carry ``spike`` and rank a removed spike first.

    Returns:
        ``(rows ranked, summary)``; the summary has ``baseline`` (the unchanged run's row),
        ``total_s``, ``per_candidate_s`` and ``note`` (:data:`EVIDENCE_NOT_PROOF`).
    """
    t0 = time.perf_counter()
    follow = len([s for s in engine.steps if s > start])
    ref = _reference(engine, start)
    base = _row(engine.run(Change("as recorded"), start, follow), ref)
    rows = []
    for ch in candidates(report, engine, grad_norms):
        o = engine.run(ch, start, follow)
        row = _row(o, ref)
        if spike_bar is not None and math.isfinite(spike_bar):
            v = o.losses.get(start if spike_step is None else spike_step)
            row["spike"] = v is None or not math.isfinite(v) or v >= spike_bar
        rows.append(row)

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        d = r["loss_distance"]
        return (not r["finite"], bool(r.get("spike", False)), math.inf if d is None else d)
    rows.sort(key=key)
    total = time.perf_counter() - t0
    summary = {"baseline": base, "total_s": round(total, 4), "note": EVIDENCE_NOT_PROOF,
               "per_candidate_s": round(sum(r["wall_s"] for r in rows) / len(rows), 4) if rows else 0.0,
               "steps": [s for s in engine.steps if s >= start]}
    return rows, summary
