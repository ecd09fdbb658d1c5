"""Text of the counterfactual parts of a verdict (replay/counterfactual.py): a spike verdict's title
and facts, the what-if candidates table and the reproducibility class. Used by
:func:`sentineld.contracts.render.render_verdict` (the one renderer); imports no torch.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["spike_title", "spike_lines", "what_if_lines", "reproducibility_lines", "WHAT_IF_NOTE"]

#: Said under every what-if table (README too).
WHAT_IF_NOTE = ("a candidate that stays finite for the checked steps is evidence, not proof: the "
                "steps after the capture were never run with it")


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-"
    if isinstance(v, (int, float)):
        return repr(float(v)) if not math.isfinite(float(v)) else f"{float(v):.4g}"
    return str(v)


def spike_title(r: Mapping[str, Any]) -> str:
    """``[sentineld] replay of run R: loss spike at step N: cause data (samples [5, 17])``."""
    cls = r.get("cause_class") or "?"
    detail = ""
    if cls == "data" and r.get("samples"):
        detail = f" (samples {list(r['samples'])[:8]})"
    elif cls == "state":
        q = ((r.get("evidence") or {}).get("state") or {}).get("quantity")
        detail = f" (module {r.get('module') or '-'}" + (f", {q})" if q else ")")
    run, step = r.get("run_id", "?"), r.get("step", "?")
    return f"[sentineld] replay of run {run}: loss spike at step {step}: cause {cls}{detail}"


def spike_lines(r: Mapping[str, Any]) -> list[str]:
    """The facts of a spike verdict: the 2x2 losses, the samples or the state's module."""
    ev: Mapping[str, Any] = r.get("evidence") or {}
    cells: Mapping[str, Any] = ev.get("losses") or {}
    n, e, j = r.get("step"), ev.get("earlier_state_step"), ev.get("neighbour_batch_step")
    lines = [f"kind: loss spike (finite)  cause: {r.get('cause_class')}",
             f"step: {n}  recorded loss {_num(ev.get('recorded_loss'))}, replayed {_num(ev.get('replayed_loss'))}, "
             f"reference {_num(ev.get('reference_loss'))}, spikes at >= {_num(ev.get('spike_bar'))}",
             f"2x2 losses          batch {n}     batch {j if j is not None else '-'}",
             f"  state before {n}:  {_num(cells.get('this_state_this_batch')):>10}  "
             f"{_num(cells.get('this_state_neighbour_batch')):>10}",
             f"  state before {e if e is not None else '-'}:  {_num(cells.get('earlier_state_this_batch')):>10}  "
             f"{_num(cells.get('earlier_state_neighbour_batch')):>10}"]
    if r.get("samples"):
        ps = ev.get("per_sample") or {}
        top = ", ".join(f"{t.get('sample')} (loss {_num(t.get('loss'))}, grad share {_num(t.get('grad_share'))})"
                        for t in (ps.get("top") or [])[:6])
        lines.append(f"samples: {list(r['samples'])[:16]}" + (f"  {top}" if top else ""))
        if ps.get("share_of_excess") is not None:
            lines.append(f"  they carry {100 * float(ps['share_of_excess']):.0f}% of the batch's excess loss "
                         f"(per-sample by {ps.get('method')})")
    st = ev.get("state")
    if isinstance(st, Mapping) and st.get("module") is not None:
        lines.append(f"module: {st.get('module')} ({r.get('module_type') or '-'}), update ratio "
                     f"{_num(st.get('update_ratio'))} (before: {_num(st.get('previous_update_ratio'))})")
        if st.get("why"):
            lines.append(f"behind it: {st['why']}")
    lines.append(f"reproduced: {r.get('reproduced')} (snapshot at step {ev.get('snapshot_step')})")
    return lines


def what_if_lines(r: Mapping[str, Any]) -> list[str]:
    """The candidates table (ranked as the replay ranked them), or nothing without ``what_if``."""
    rows = r.get("what_if") or []
    if not rows:
        return []
    out = ["what-if (each on a fresh copy of the captured state):",
           f"  {'change':<52} {'finite':<6} {'steps':>5} {'loss':>11} {'distance':>10}"]
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        note = "  spike gone" if row.get("spike") is False else ("  still spikes" if row.get("spike") else "")
        if row.get("error"):
            note += f"  error: {str(row['error'])[:60]}"
        elif row.get("applied") == 0:
            note += "  " + _unchanged(row)
        elif row.get("rewritten_as"):
            note += f"  (as {', '.join(map(str, row['rewritten_as']))})"
        out.append(f"  {str(row.get('change'))[:52]:<52} {str(bool(row.get('finite'))):<6} "
                   f"{int(row.get('steps_checked') or 0):>5} {_num(row.get('loss')):>11} "
                   f"{_num(row.get('loss_distance')):>10}{note}")
    out.append(f"  note: {WHAT_IF_NOTE}")
    return out


def _unchanged(row: Mapping[str, Any]) -> str:
    """Why a guard row changed nothing: the op never ran where it looked, or it ran and its call
    sites could not be changed (a ``log`` rewrite needs an input made by sigmoid, softmax, 1+x
    or 1+exp). A row without ``op_calls`` (a verdict of schema 3 before it) says no more than that."""
    calls = row.get("op_calls")
    if calls is None:
        return "(no call site changed)"
    if not calls:
        return "(the op never ran there)"
    if "rewrite" in str(row.get("change")):
        return f"(no change: ran {calls}x, input not from sigmoid/softmax/1+x/1+exp)"
    return f"(no change: ran {calls}x)"


def reproducibility_lines(r: Mapping[str, Any]) -> list[str]:
    """``reproducibility: software (...)`` and what was ruled out, or nothing."""
    rep = r.get("reproducibility")
    if not isinstance(rep, Mapping):
        return []
    out = [f"reproducibility: {rep.get('class')} ({rep.get('repeats')} repeats, identical "
           f"{rep.get('identical')}): {rep.get('why', '')}"]
    if rep.get("ruled_out"):
        out.append(f"  ruled out: {', '.join(map(str, rep['ruled_out']))}")
    return out
