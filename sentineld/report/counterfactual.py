"""The report's counterfactual parts (replay/counterfactual.py): a spike verdict's head and facts
(cause, the samples, the module, the 2x2 losses), the what-if candidates table and the
reproducibility class, as HTML fragments for :mod:`sentineld.report.page`."""

from __future__ import annotations

import math
from html import escape
from typing import Any, Mapping

from sentineld.contracts.render_cf import WHAT_IF_NOTE

__all__ = ["spike_head", "spike_rows", "what_if_html"]


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return escape(str(v))
    return repr(f) if not math.isfinite(f) else f"{f:.4g}"


def spike_head(v: Mapping[str, Any]) -> str:
    """``step 40: loss spike, cause data, samples [5, 17, 22]`` (plain text)."""
    head = f"step {v.get('step')}: loss spike, cause {v.get('cause_class')}"
    if v.get("samples"):
        head += f", samples {list(v['samples'])[:16]}"
    if v.get("module"):
        head += f", module {v['module']}"
    return head


def spike_rows(v: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` rows of a spike verdict: the 2x2 losses and what is behind the cause."""
    ev: Mapping[str, Any] = v.get("evidence") or {}
    c: Mapping[str, Any] = ev.get("losses") or {}
    n, e, j = v.get("step"), ev.get("earlier_state_step"), ev.get("neighbour_batch_step")
    rows = [("batch {0} / batch {1} on the state before {0}".format(n, j),
             f"{_num(c.get('this_state_this_batch'))} / {_num(c.get('this_state_neighbour_batch'))}"),
            (f"batch {n} / batch {j} on the state before {e}",
             f"{_num(c.get('earlier_state_this_batch'))} / {_num(c.get('earlier_state_neighbour_batch'))}"),
            ("reference loss, spike bar", f"{_num(ev.get('reference_loss'))}, {_num(ev.get('spike_bar'))}")]
    top = (ev.get("per_sample") or {}).get("top") or []
    if top:
        rows.append(("samples (loss, grad-norm share)", "; ".join(
            f"{t.get('sample')}: {_num(t.get('loss'))}, {_num(t.get('grad_share'))}" for t in top[:8])))
    st = ev.get("state")
    if isinstance(st, Mapping) and st.get("why"):
        rows.append(("behind it", str(st["why"])))
    return rows


def what_if_html(v: Mapping[str, Any]) -> str:
    """The candidates table and the reproducibility class, or "" without them."""
    out = []
    rows = [r for r in v.get("what_if") or [] if isinstance(r, Mapping)]
    if rows:
        head = "".join(f"<th>{h}</th>" for h in ("change", "finite", "steps checked", "loss", "distance", "note"))
        body = "".join(
            "<tr>" + "".join(f"<td>{x}</td>" for x in (
                escape(str(r.get("change"))), "yes" if r.get("finite") else "no", int(r.get("steps_checked") or 0),
                _num(r.get("loss")), _num(r.get("loss_distance")),
                escape(str(r.get("error") or ("spike gone" if r.get("spike") is False else
                                              "still spikes" if r.get("spike") else ""))))) + "</tr>"
            for r in rows)
        out.append(f"<h3>What-if candidates</h3><table><tr>{head}</tr>{body}</table>"
                   f"<p>{escape(WHAT_IF_NOTE)}.</p>")
    rep = v.get("reproducibility")
    if isinstance(rep, Mapping):
        out.append(f"<p><b>reproducibility: {escape(str(rep.get('class')))}</b> ({escape(str(rep.get('why', '')))}; "
                   f"ruled out: {escape(', '.join(map(str, rep.get('ruled_out') or [])) or '-')})</p>")
    return "".join(out)
