"""Assemble the report: one self-contained HTML page (inline CSS and SVG, no script, no link).

Each plot is a ``<figure class="plot" id="plot-<name>">`` holding one inline ``<svg>``; a section
whose data is missing says why in a ``<p class="unavailable">`` instead. The page names its plots
in ``<meta name="sentineld-plots">`` so a check can compare what was meant with what rendered.
Every text from the run (module names, messages, the user's error strings) is HTML-escaped.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from html import escape
from typing import Any

from sentineld.contracts.render import tensor_stats_text

from . import figures as f
from .counterfactual import spike_head, spike_rows, what_if_html
from .data import ReportData, alert_rows

__all__ = ["render_html", "PLOT_IDS"]

#: Every plot the page can hold, in page order.
PLOT_IDS = ("curves", "grad_norm", "update_ratio", "dead_or_saturated", "weights", "activations",
            "timeline", "replay")

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
figure.plot{margin:12px 0}figure.plot svg{max-width:100%;height:auto}
figcaption{font-size:13px;color:#555}.unavailable{color:#8a6d3b;background:#fcf8e3;padding:8px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
pre{background:#f6f8fa;padding:10px;font-size:12px;overflow:auto;max-height:480px}
.verdict{font-size:15px;background:#f2ecfa;padding:10px;border-left:4px solid #9467bd}
.meta td:first-child{color:#555}
"""


def _figure(name: str, svg: str, caption: str) -> str:
    return (f'<figure class="plot" id="plot-{name}">{svg}<figcaption>{escape(caption)}</figcaption>'
            "</figure>")


def _missing(text: str) -> str:
    return f'<p class="unavailable">{escape(text)}</p>'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.6g}"
    return "-" if v is None else str(v)


def _meta_table(r: ReportData) -> str:
    m = r.meta
    rows = [("run", r.run_id), ("run dir", r.run_dir), ("rank", f"{r.rank} of {m.get('world_size')}"),
            ("recipe", m.get("recipe") or "-"), ("working dir", m.get("cwd")), ("host", m.get("host")),
            ("torch", m.get("torch_version")),
            ("started", dt.datetime.fromtimestamp(m.get("started_s") or 0, dt.timezone.utc).isoformat())]
    if r.capture:
        c = r.capture
        rows.append(("capture", f"{c['path']} (trigger {c['trigger']}, incident step {c['first_step']}, "
                                f"snapshot step {c['snapshot_step']}, steps {c['steps'][0]}..{c['steps'][-1]})"))
    body = "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="meta">{body}</table>'


def _layers(r: ReportData, plots: list[str]) -> str:
    out = ["<h2>Per-layer statistics over steps</h2>"]
    spec = {"grad_norm": ("grad norm", True, "L2 norm of each module's own parameter gradients"),
            "update_ratio": ("update ratio", True, "||delta w|| / ||w|| over each optimizer step "
                                                   "(the method's rule of thumb: about 1e-3)"),
            "dead_or_saturated": ("dead or saturated share", False,
                                  "share of units never > 0 (ReLU family) or saturated (Tanh, Sigmoid)")}
    for g in r.grids:
        title, log, caption = spec[g.name]
        if not g.modules or not len(g.steps):
            out.append(_missing(f"no per-layer {title} samples in the stream (the agent samples "
                                "layers every layer_every steps; 0 turns it off)"))
            continue
        plots.append(g.name)
        shown = (f"; {len(g.modules)} of {g.total_modules} modules (those with NaN/Inf first)"
                 if g.total_modules > len(g.modules) else "")
        out.append(_figure(g.name, f.heatmap_svg(g, title, log, r.markers),
                           f"{caption}; grey: no value at that step, red cross: NaN/Inf{shown}"))
    return "".join(out)


def _tensors(r: ReportData, plots: list[str]) -> str:
    out = ["<h2>Weights and activations at the capture</h2>"]
    if r.weights:
        plots.append("weights")
        s = (r.capture or {}).get("snapshot_step")
        out.append(_figure("weights", f.hists_svg(r.weights, f"weights at snapshot step {s}", "weights"),
                           f"model tensors of the capture's snapshot (the state before step {s}); "
                           "red panels hold NaN/Inf"))
    else:
        out.append(_missing(r.activations_note or "no weights in the capture"))
    if r.activations:
        plots.append("activations")
        out.append(_figure("activations", f.hists_svg(r.activations, "activations", "activations"),
                           r.activations_note))
    elif r.weights:
        out.append(_missing(r.activations_note))
    return "".join(out)


def _alerts(r: ReportData, plots: list[str]) -> str:
    out = ["<h2>Alert timeline</h2>"]
    rows = alert_rows(r.alerts)
    if not rows:
        return "".join(out) + _missing("no alerts recorded for this run (none in the daemon's outbox, "
                                       "or no daemon state dir given)")
    if any(isinstance(x["step"], int) for x in rows):
        plots.append("timeline")
        st = r.curves.steps
        span = (int(st.min()), int(st.max())) if len(st) else None
        out.append(_figure("timeline", f.timeline_svg(rows, r.markers, span), "from the daemon's outbox"))
    head = ("<tr><th>time (UTC)</th><th>kind</th><th>severity</th><th>signature</th><th>step</th>"
            "<th>title</th><th>delivered</th></tr>")
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in (
            dt.datetime.fromtimestamp(x["created_s"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            x["kind"], x["severity"], x["signature"], _fmt(x["step"]), x["title"], x["delivered"])) + "</tr>"
        for x in rows)
    return "".join(out) + f"<table>{head}{body}</table>"


def _verdict(r: ReportData, plots: list[str]) -> str:
    out = ["<h2>Replay verdict</h2>"]
    v = r.verdict
    if v is None:
        return "".join(out) + _missing(r.verdict_note)
    where = f" in {v.get('phase')}" + (f", module {v['module']} ({v.get('module_type')})" if v.get("module")
                                       else f", {v['where']}" if v.get("where") else "")  # module null: say where
    op = f", op {v['op']}" if v.get("op") else ""
    forward_only = (v.get("evidence") or {}).get("mode") == "forward_only"
    head = (f"step {v.get('step')}: the model's forward is finite (loss, backward and optimizer step not checked)"
            if v.get("phase") == "none" and forward_only
            else f"step {v.get('step')}: every value finite" if v.get("phase") == "none"
            else f"step {v.get('step')}: first non-finite value made{where}{op}")
    if v.get("kind") == "spike":
        head = spike_head(v)
    out.append(f'<p class="verdict">{escape(head)}</p>')
    rows = [*(spike_rows(v) if v.get("kind") == "spike" else []),
            ("reproduced", f"{v.get('reproduced')} (max loss deviation {_fmt(v.get('max_loss_deviation'))} "
                           f"over {v.get('steps_rebuilt')} rebuilt steps)"),
            ("parameters", ", ".join(v.get("parameters") or []) or "-")]
    ev0 = v.get("evidence") or {}
    if ev0.get("op_inputs") is not None and v.get("op") and v.get("op") != "lr":
        # The notification's one-line summaries, not only the raw JSON below.
        rows += [("op inputs", "; ".join(tensor_stats_text(x) for x in ev0["op_inputs"]) or "-"),
                 ("op output", tensor_stats_text(ev0.get("op_output")))]
    if ev0.get("samples"):
        rows.append(("samples", f"{ev0['samples']} (rows of the batch that went non-finite first)"))
    rows += [("likely cause", v.get("cause", "")), ("fix", v.get("fix", ""))]
    out.append("<table>" + "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(x))}</td></tr>" for k, x in rows)
               + "</table>")
    out.append(what_if_html(v))
    ev = v.get("evidence") or {}
    rebuilt = {int(k): _float(x) for k, x in (ev.get("rebuilt_losses") or {}).items()}
    # Recorded losses from the run's own stream (the verdict holds only the offending step's).
    recorded = {int(s): float(x) for s, x in zip(r.curves.steps, r.curves.loss) if int(s) in rebuilt}
    if rebuilt:
        rec = ev.get("recorded_loss")
        if rec is not None and v.get("step") is not None:
            recorded[int(v["step"])] = _float(rec)
        plots.append("replay")
        out.append(_figure("replay", f.replay_losses_svg(rebuilt, recorded),
                           "each rebuilt step's loss; the replay compares them with the recorded ones bit for bit"))
    out.append("<h3>Evidence</h3><pre>" + escape(json.dumps(ev, indent=1, sort_keys=True, default=str)) + "</pre>")
    return "".join(out)


def _verdict_or_note(r: ReportData, plots: list[str]) -> str:
    """:func:`_verdict`, or a note when a field of the verdict has a type the page cannot show (a
    hand-edited or foreign verdict file: ``"what_if": 7``): the rest of the page is still written."""
    shown: list[str] = []  # its plots are listed only when the section is written
    try:
        html = _verdict(r, shown)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        return ("<h2>Replay verdict</h2>" + _missing(
            f"the verdict cannot be shown: a field has the wrong type ({type(exc).__name__}: {str(exc)[:200]}); it is "
            f"not a verdict sentineld wrote. Replay again for a fresh one: sentineld replay {r.run_dir} --json "
            "(or sentineld report RUN --replay)"))
    plots += shown
    return html


def _float(x: Any) -> float:
    try:
        return float(x)  # the replay's strict JSON writes NaN as the string "nan"
    except (TypeError, ValueError):
        return math.nan


def render_html(r: ReportData) -> str:
    """The whole page for ``r``."""
    plots: list[str] = []
    parts = [f"<h1>sentineld report: run {escape(r.run_id)}</h1>", _meta_table(r)]
    parts += [_missing(n) for n in r.notes]
    parts.append("<h2>Training curves</h2>")
    if len(r.curves.steps):
        plots.append("curves")
        parts.append(_figure("curves", f.curves_svg(r.curves, r.markers),
                             "red line: capture (incident); orange dashed: alert; red cross: non-finite value"))
    else:
        parts.append(_missing("no step records: nothing to plot"))
    parts += [_layers(r, plots), _tensors(r, plots), _alerts(r, plots), _verdict_or_note(r, plots)]
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"sentineld-plots\" content=\"{','.join(plots)}\">"
            f"<title>sentineld report {escape(r.run_id)}</title><style>{_CSS}</style></head><body>"
            + "".join(parts) + f"<p><small>written by sentineld at {when}</small></p></body></html>\n")
