"""Why a finite loss spiked: the 2x2 counterfactual on the captured state (issue 21, part 3).

PaLM's analysis of its spikes found that they need a specific batch *and* a specific state. The
loss of step N is the forward of batch N on the state before N, so the engine
(:mod:`replay.counterfactual`) swaps one of the two at a time:

=====================  =========================  ==============================
                       batch N                    neighbouring batch J
=====================  =========================  ==============================
state before N         the spike (reproduced?)    does this state spike anyway?
earlier state E        does this batch spike?     the reference level
=====================  =========================  ==============================

E is the state before N-1 (one update earlier; further back when N-1 itself spiked), J the
batch of N-1 (N+1 when there is no N-1). A cell *spikes* when its loss is at least half as far
above the reference as the spike itself (the reference: the median of the recorded losses before
N and the E/J cell). Batch N spikes on both states: **data** (per-sample loss and grad-norm share
name the samples); only this state spikes, on both batches: **state** (the module whose update
ratio jumped in the step that made this state, and the optimizer quantity behind it: a jump of
the lr, Adam's normalized step past its bound, i.e. a second moment ~0, or the module's gradient
norm); only the pair: **interaction**; the spike not reproduced from the captured state:
**not_reproduced**.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import Finding, Replayed

from .counterfactual import Change, Engine
from .persample import per_sample, responsible
from .rebuild import same_loss

__all__ = ["explain_spike", "SPIKE_SHARE"]

#: A cell spikes when its excess over the reference is at least this share of the spike's.
SPIKE_SHARE = 0.5
#: Adam's normalized step |m_hat / (sqrt(v_hat) + eps)| is at most (1 - b1) / sqrt(1 - b2) ~ 3.2
#: (b1 0.9, b2 0.999) when v tracks the gradient; a module stepping past this had a second moment
#: ~0 against its first (Molybog et al. 2023, "A theory on Adam instability").
ADAM_BOUND = 3.2


def _pick_earlier(engine: Engine, n: int, spiky: Any) -> int | None:
    """The latest state before ``n`` whose own recorded loss did not spike."""
    for e in range(n - 1, engine.snapshot_step - 1, -1):
        if not spiky(engine.recorded.get(e)):
            return e
    return engine.snapshot_step if engine.snapshot_step < n else None


def _pick_neighbour(engine: Engine, n: int, spiky: Any) -> int | None:
    before = [s for s in engine.steps if s < n and not spiky(engine.recorded.get(s))]
    after = [s for s in engine.steps if s > n and not spiky(engine.recorded.get(s))]
    return before[-1] if before else (after[0] if after else None)


def _calm_step(engine: Engine, n: int, flagged: int | None, recorded: float | None,
               level: float | None) -> str | None:
    """Why step ``n`` is no spike to explain (None when it is, or nothing says otherwise): its
    recorded loss's excess over ``level`` (the median before ``n``) is under :data:`SPIKE_SHARE`
    of the flagged step's excess over the same level."""
    if flagged is None or flagged == n or level is None or recorded is None or not math.isfinite(recorded):
        return None
    peak = engine.recorded.get(flagged)
    if peak is None or not math.isfinite(peak) or peak <= level:
        return None
    if recorded - level >= SPIKE_SHARE * (peak - level):
        return None
    return (f"step {n} did not spike: its recorded loss {recorded:.4g} is {recorded - level:+.3g} from the level "
            f"{level:.4g} before it, under {SPIKE_SHARE:g} of the excess of the flagged spike at step {flagged} "
            f"(loss {peak:.4g})")


def _module_of(pname: str) -> str:
    return pname.rpartition(".")[0]


def _param_map(state: Any) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state["model"].items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _update_ratios(before: Any, after: Any, trainable: set[str]) -> dict[str, float]:
    """Per module: ||w_after - w_before|| / ||w_before|| over its own parameters."""
    a, b = _param_map(before), _param_map(after)
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for k in trainable:
        if k in a and k in b:
            m = _module_of(k)
            num[m] = num.get(m, 0.0) + float((b[k] - a[k]).pow(2).sum())
            den[m] = den.get(m, 0.0) + float(a[k].pow(2).sum())
    return {m: math.sqrt(num[m]) / max(math.sqrt(den[m]), 1e-12) for m in num}


def _lr_of(state: Any) -> float | None:
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _module_grad_norms(engine: Engine, step: int) -> dict[str, float]:
    got: dict[str, float] = {}

    def probe(_s: int, rec: Recipe) -> None:
        if got:
            return
        for name, p in rec.model.named_parameters():
            if p.grad is not None:
                m = _module_of(name)
                got[m] = got.get(m, 0.0) + float(p.grad.detach().float().pow(2).sum())
    engine.run(Change("probe"), step, 0, on_optimizer=probe)
    return {m: math.sqrt(v) for m, v in got.items()}


def _normalized_step(before: Any, after: Any, module: str, lr: float | None) -> float | None:
    """RMS of |delta w| / lr over the module's parameters (Adam's normalized step)."""
    if not lr:
        return None
    a, b = _param_map(before), _param_map(after)
    keys = [k for k in a if _module_of(k) == module and k in b]
    if not keys:
        return None
    sq = sum(float((b[k] - a[k]).pow(2).sum()) for k in keys)
    count = sum(a[k].numel() for k in keys)
    return math.sqrt(sq / max(count, 1)) / lr


def _blame_state(engine: Engine, n: int, e: int, rec: Recipe) -> dict[str, Any]:
    """The module whose update jumped in the steps that made state N, and the quantity behind it."""
    trainable = {k for k, p in rec.model.named_parameters() if p.requires_grad}
    s_e, s_n = engine.state_before(e), engine.state_before(n)
    now = _update_ratios(s_e, s_n, trainable)
    prev: dict[str, float] = {}
    if e - 1 >= engine.snapshot_step:
        prev = _update_ratios(engine.state_before(e - 1), s_e, trainable)
    jump = {m: r / max(prev.get(m, 0.0), 1e-12) if prev else r for m, r in now.items()}
    if not jump:
        return {"module": None}
    module = max(jump, key=lambda m: jump[m])
    out: dict[str, Any] = {"module": module, "update_ratio": now[module], "previous_update_ratio": prev.get(module),
                           "update_ratios": dict(sorted(now.items(), key=lambda kv: -kv[1])[:8]),
                           "made_by_steps": f"{e}..{n - 1}"}
    lr_e = _lr_of(s_e)
    lr_prev = _lr_of(engine.state_before(e - 1)) if e - 1 >= engine.snapshot_step else None
    if lr_prev is None and isinstance((engine.records.get(e - 2) or {}).get("lr"), (int, float)):
        lr_prev = float(engine.records[e - 2]["lr"])  # the record's lr is the one set for the next step
    adam = any("exp_avg_sq" in st for st in (s_e.get("optimizer") or {}).get("state", {}).values())
    step_now = _normalized_step(s_e, s_n, module, lr_e)
    step_prev = _normalized_step(engine.state_before(e - 1), s_e, module, lr_prev) \
        if e - 1 >= engine.snapshot_step else None
    out.update(lr=lr_e, previous_lr=lr_prev, normalized_step=step_now, previous_normalized_step=step_prev)
    if lr_e is not None and lr_prev and lr_e >= 2 * lr_prev:
        out["quantity"] = "lr"
        out["why"] = (f"the learning rate of step {e} was {lr_e:.3g}, {lr_e / lr_prev:.3g}x the step "
                      f"before's {lr_prev:.3g}")
        return out
    if adam and step_now is not None and step_now > ADAM_BOUND:
        out["quantity"] = "second_moment"
        out["why"] = (f"Adam's normalized step of {module or 'the model'} was {step_now:.3g} (|delta w| / lr; "
                      f"bounded by ~{ADAM_BOUND} while the second moment tracks the gradient): its second "
                      "moment exp_avg_sq was ~0 against the first")
        return out
    g_now, g_prev = _module_grad_norms(engine, e), (_module_grad_norms(engine, e - 1)
                                                      if e - 1 >= engine.snapshot_step else {})
    gn, gp = g_now.get(module), g_prev.get(module)
    out.update(grad_norm=gn, previous_grad_norm=gp)
    out["quantity"] = "grad_norm"
    if gn is None:
        out["why"] = "the update of this module jumped"
    else:
        out["why"] = (f"the gradient norm of {module or 'the model'} in step {e} was {gn:.3g}"
                      + (f", {gn / gp:.3g}x the step before's" if gp else ""))
    return out


def explain_spike(engine: Engine, n: int, flagged: int | None = None) -> Replayed:
    """The 2x2 verdict of step ``n``: a :class:`Finding` of ``kind`` spike (``phase`` none, every
    value being finite), with whether the rebuild reproduced the recorded loss; the caller adds
    where it came from (rank, capture, rebuild).

    ``flagged``: the step the spike rule flagged (the capture's). Another requested step is
    explained only when its own recorded loss is a spike on that scale (its excess over the
    level before it at least :data:`SPIKE_SHARE` of the flagged step's); otherwise the verdict is
    ``not_reproduced``, saying the step did not spike and which one did (a calm step 0.03 above
    its level was called a data spike: any loss above the reference passed).

    Raises:
        ValueError: ``n`` is not a captured step at or after the snapshot.
    """
    t0 = time.perf_counter()
    recorded = engine.recorded.get(n)
    earlier = [v for s, v in sorted(engine.recorded.items()) if s < n and math.isfinite(v)]
    this = engine.run(Change("the spiking step as recorded"), n)
    l_nn = this.losses.get(n, math.nan)
    level_guess = statistics.median(earlier) if earlier else None
    calm = _calm_step(engine, n, flagged, recorded, level_guess)
    if calm is not None:
        ev0: dict[str, Any] = {"recorded_loss": recorded, "replayed_loss": l_nn, "flagged_step": flagged,
                               "level_before": level_guess, "spike_share": SPIKE_SHARE,
                               "recorded_losses": {str(s): v for s, v in sorted(engine.recorded.items())},
                               "rebuilt_losses": {str(s): v for s, v in
                                                  sorted({**engine.rebuilt.losses, n: l_nn}.items()) if s <= n}}
        found = Finding(n, kind="spike", cause_class="not_reproduced", evidence=ev0, cause=calm,
                        fix=f"replay the flagged step: sentineld replay RUN --step {flagged} (the default)")
        dev = engine.rebuilt.max_deviation
        if recorded is not None and math.isfinite(l_nn) and not same_loss(l_nn, recorded):
            dev = max(dev, abs(l_nn - recorded))
        return Replayed(found, requested_step=n, max_loss_deviation=dev,
                        localize_s=round(time.perf_counter() - t0, 4),
                        reproduced=engine.rebuilt.equal and recorded is not None and same_loss(l_nn, recorded))
    peak = recorded if recorded is not None and math.isfinite(recorded) else l_nn

    def spiky(v: float | None) -> bool:
        if v is None or level_guess is None or not math.isfinite(peak) or peak <= level_guess:
            return False
        return v - level_guess >= SPIKE_SHARE * (peak - level_guess)
    e, j = _pick_earlier(engine, n, spiky), _pick_neighbour(engine, n, spiky)
    cells: dict[str, float | None] = {"this_state_this_batch": l_nn, "earlier_state_this_batch": None,
                                      "this_state_neighbour_batch": None, "earlier_state_neighbour_batch": None}

    def cell(label: str, state: int | None, batch: int | None) -> float | None:
        return engine.run(Change(label, state_before=state, batch_from=batch), n).losses.get(n)
    if e is not None:
        cells["earlier_state_this_batch"] = cell("this batch on the earlier state", e, None)
    if j is not None:
        cells["this_state_neighbour_batch"] = cell("neighbour batch on this state", None, j)
    if e is not None and j is not None:
        cells["earlier_state_neighbour_batch"] = cell("neighbour batch on the earlier state", e, j)
    base = cells["earlier_state_neighbour_batch"]
    ref_pool = earlier[-16:] + ([base] if base is not None else [])
    ref = statistics.median(ref_pool) if ref_pool else math.nan
    bar = ref + SPIKE_SHARE * (l_nn - ref) if math.isfinite(ref) and math.isfinite(l_nn) else math.nan

    def spikes(v: float | None) -> bool | None:
        return None if v is None or not math.isfinite(bar) else (not math.isfinite(v) or v >= bar)
    batch_both = spikes(cells["earlier_state_this_batch"])
    state_both = spikes(cells["this_state_neighbour_batch"])
    reproduced_spike = math.isfinite(ref) and math.isfinite(l_nn) and l_nn > ref and (
        recorded is None or not math.isfinite(recorded) or l_nn - ref >= SPIKE_SHARE * (recorded - ref))
    ev: dict[str, Any] = dict(
        losses=cells, reference_loss=ref, spike_bar=bar, recorded_loss=recorded, replayed_loss=l_nn,
        earlier_state_step=e, neighbour_batch_step=j, spike_share=SPIKE_SHARE,
        recorded_losses={str(s): v for s, v in sorted(engine.recorded.items())},
        # the steps re-executed on the way to the state before n, and n itself (a compiled run's
        # eager replay is compared with these: replay/compiled.py)
        rebuilt_losses={str(s): v for s, v in sorted({**engine.rebuilt.losses, n: l_nn}.items()) if s <= n})
    rec = engine.fresh(n)
    if not reproduced_spike:
        found = Finding(n, kind="spike", cause_class="not_reproduced", evidence=ev,
                        cause=(f"the replayed loss {l_nn:.4g} of step {n} is not a spike over the reference "
                               f"{ref:.4g} (recorded {recorded})"),
                        fix="a source the capture does not hold changed the step (see reproducibility with --what-if)")
    elif batch_both and not (state_both and (cells["this_state_neighbour_batch"] or 0)
                             > (cells["earlier_state_this_batch"] or 0)):  # both: the larger one
        found = _data(engine, n, rec, ev)
    elif state_both:
        found = _state(engine, n, e, rec, ev)
    else:
        found = Finding(n, kind="spike", cause_class="interaction", evidence=ev,
                        cause=("only this batch on this state spikes: neither the batch on the earlier state nor "
                               "another batch on this state does"),
                        fix=("lower the lr or clip for this stretch, or skip the step (as OLMo-core's skip-step "
                             "optimizer does)"))
    dev = engine.rebuilt.max_deviation
    if recorded is not None and not same_loss(l_nn, recorded):
        dev = max(dev, abs(l_nn - recorded) if math.isfinite(l_nn) and math.isfinite(recorded) else math.inf)
    return Replayed(found, requested_step=n, max_loss_deviation=dev, localize_s=round(time.perf_counter() - t0, 4),
                    reproduced=engine.rebuilt.equal and recorded is not None and same_loss(l_nn, recorded))


def _data(engine: Engine, n: int, rec: Recipe, ev: dict[str, Any]) -> Finding:
    batch, _ = engine.load(n)
    ps = per_sample(rec, batch)
    named = responsible(ps)
    losses = ps.get("losses") or []
    if losses:
        total = sum(v for v in losses if math.isfinite(v))
        med = sorted(losses)[len(losses) // 2]
        carried = sum(losses[i] - med for i in named if math.isfinite(losses[i]))
        excess = sum(v - med for v in losses if math.isfinite(v) and v > med) or 1.0
        ev["per_sample"] = {
            "method": ps["method"], "top": [{"sample": i, "loss": losses[i], "grad_share": ps["grad_share"][i]}
                                           for i in named[:16]],
            "batch_median_loss": med, "share_of_excess": carried / excess, "batch_mean_loss": total / len(losses),
            **({"fallback_because": ps["fallback_because"]} if ps.get("fallback_because") else {})}
    else:
        ev["per_sample"] = ps
    # phase stays "none": every value is finite
    return Finding(n, kind="spike", cause_class="data", samples=named, evidence=ev,
                   where=f"input batch of step {n}, samples {named[:8]}",
                   cause=(f"the batch of step {n} spikes on the earlier state too: samples {named[:8]} carry "
                          "most of it"),
                   fix=("inspect those samples (labels, scale, a corrupted record); drop or skip them, or clip "
                        "gradients"))


def _state(engine: Engine, n: int, e: int | None, rec: Recipe, ev: dict[str, Any]) -> Finding:
    blame = _blame_state(engine, n, e, rec) if e is not None else {"module": None}
    module = blame.get("module") or None
    module_type = None
    if module is not None:
        mods = dict(rec.model.named_modules())
        module_type = type(mods[module]).__name__ if module in mods else None
    ev["state"] = blame
    q = blame.get("quantity")
    return Finding(
        n, kind="spike", cause_class="state", module=module, module_type=module_type, evidence=ev,
        parameters=[k for k, _ in rec.model.named_parameters() if _module_of(k) == (module or "")][:16],
        op={"lr": "lr", "second_moment": "exp_avg_sq", "grad_norm": "grad_norm"}.get(q or ""),
        where=f"the state before step {n}" + (f", module '{module}'" if module else ""),
        cause=f"the state before step {n} spikes on another batch too: {blame.get('why', 'an update jumped')}",
        fix={"lr": "fix the schedule (a one-step lr jump), or clip the update",
             "second_moment": "raise Adam's eps, lower beta2, or clip this module's gradient",
             "grad_norm": "clip gradients (clip_grad_norm_) at the run's usual norm"}.get(
            q or "", "lower the lr or clip gradients"))
