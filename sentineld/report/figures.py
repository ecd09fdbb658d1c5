"""The report's figures, drawn by matplotlib and returned as inline SVG text.

Every function takes data from :mod:`sentineld.report.data` and returns one ``<svg>`` element
(no XML prolog, no external references: text is drawn as paths, so the page needs no fonts).
Markers: captures (incidents) are solid red lines, alerts dashed orange, the replay's offending
step dotted purple; non-finite values are red crosses on the top edge of their panel.
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display: the report is written by a CLI or a daemon

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colors
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, SymmetricalLogLocator

from .data import Curves, Hist, LayerGrid, Marker

__all__ = ["curves_svg", "heatmap_svg", "hists_svg", "timeline_svg", "replay_losses_svg"]

_STYLE: dict[str, dict[str, Any]] = {"capture": dict(color="#d62728", ls="-", lw=1.2),
                                     "alert": dict(color="#ff7f0e", ls="--", lw=1.0),
                                     "verdict": dict(color="#9467bd", ls=":", lw=1.4),
                                     "spike": dict(color="#2ca02c", ls="-.", lw=1.4)}


def _svg(fig: plt.Figure, name: str) -> str:
    buf = io.StringIO()
    # A salt per figure keeps matplotlib's clip-path ids unique across the SVGs of one page.
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"sentineld-{name}"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _markers(ax: plt.Axes, markers: Sequence[Marker], labelled: set[str]) -> None:
    for m in markers:
        style = _STYLE.get(m.kind, _STYLE["alert"])
        label = None if m.kind in labelled else {
            "capture": "capture (incident)", "alert": "alert", "verdict": "replay verdict",
            "spike": "loss spike (capture)"}.get(m.kind, m.kind)
        labelled.add(m.kind)
        ax.axvline(m.step, label=label, **style)


def _scale(ax: plt.Axes, vals: np.ndarray) -> None:
    """A log axis for values spanning decades (losses of 1e-8..0.6 read as a flat zero on a
    linear one): ``log`` when all are positive, ``symlog`` (linear below the smallest positive
    value) when some are 0 or negative; at most ~6 labelled decades, no minor labels."""
    v = vals[np.isfinite(vals)]
    pos = v[v > 0]
    if pos.size < 2 or pos.max() / pos.min() <= 50:
        return
    if (v > 0).all():
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=float(pos.min()))
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=6) if (v > 0).all()
                               else SymmetricalLogLocator(base=10, linthresh=float(pos.min())))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _panel(ax: plt.Axes, steps: np.ndarray, y: np.ndarray, present: np.ndarray, title: str) -> None:
    ok = present & np.isfinite(y)
    bad = present & ~np.isfinite(y)
    ax.plot(steps[ok], y[ok], lw=1.0, color="#1f77b4")
    if ok.any():
        _scale(ax, y[ok])  # losses and norms spanning decades
    if bad.any():
        ax.plot(steps[bad], np.full(bad.sum(), 0.97), "x", color="#d62728", ms=7, mew=2,
                transform=ax.get_xaxis_transform(), label="non-finite", clip_on=False)
    ax.set_ylabel(title)
    ax.grid(alpha=0.3)
    if not present.any():
        ax.text(0.5, 0.5, f"no {title} recorded", transform=ax.transAxes, ha="center", va="center")


def curves_svg(c: Curves, markers: Sequence[Marker]) -> str:
    """Loss, grad norm and learning rate over steps (three panels, shared step axis)."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    panels = [(c.loss, np.ones_like(c.loss, dtype=bool), "loss"),
              (c.grad_norm, c.grad_norm_present, "grad norm"), (c.lr, c.lr_present, "learning rate")]
    labelled: set[str] = set()
    for ax, (y, present, title) in zip(axes, panels):
        _panel(ax, c.steps, y, present, title)
        _markers(ax, markers, labelled)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("step")
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        axes[0].legend(handles, labels, loc="upper left", fontsize=8)
    fig.suptitle("loss, grad norm and learning rate per step")
    return _svg(fig, "curves")


def heatmap_svg(g: LayerGrid, title: str, log: bool, markers: Sequence[Marker] = ()) -> str:
    """Per-module heatmap over the sampled steps; log10 colour scale when ``log``.

    Grey cells: the module had no value at that step; red crosses: the value was NaN/Inf.
    """
    vals = g.values.copy()
    bad = ~np.isfinite(vals) & ~g.missing
    shown = np.where(np.isfinite(vals), vals, np.nan)
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            shown = np.where(shown > 0, np.log10(shown), np.nan)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(g.modules) + 1.6))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    finite = shown[np.isfinite(shown)]
    norm = colors.Normalize(*(finite.min(), finite.max()) if finite.size else (0, 1))
    if not log and g.name == "dead_or_saturated":
        norm = colors.Normalize(0.0, 1.0)
    x = np.arange(len(g.steps))
    im = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=norm, extent=(-0.5, len(g.steps) - 0.5, len(g.modules) - 0.5, -0.5))
    if bad.any():
        ii, jj = np.nonzero(bad)
        ax.plot(jj, ii, "x", color="#d62728", ms=6, mew=2, label="non-finite")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_yticks(range(len(g.modules)), g.modules, fontsize=8)
    ticks = x[:: max(1, math.ceil(len(x) / 12))]
    ax.set_xticks(ticks, [str(int(g.steps[t])) for t in ticks])
    for m in markers:
        j = np.searchsorted(g.steps, m.step)
        if j < len(g.steps) and g.steps[j] == m.step and m.kind == "capture":
            ax.axvline(float(j), **_STYLE["capture"])
    ax.set_xlabel("step (sampled)")
    fig.colorbar(im, ax=ax, label=("log10 " if log else "") + title, fraction=0.03)
    ax.set_title(title + " per module")
    return _svg(fig, f"heat-{g.name}")


def hists_svg(hs: Sequence[Hist], title: str, name: str) -> str:
    """Small multiples: one histogram per tensor (log count axis), NaN/Inf counts in the titles."""
    n = len(hs)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.7 * cols, 2.1 * rows), squeeze=False)
    for ax, h in zip(axes.flat, hs):
        if h.values.size:
            ax.hist(h.values, bins=50, color="#1f77b4", log=True)
            # Decades only: minor labels (6x10^0, 4x10^0, ...) crowd a small panel.
            ax.yaxis.set_major_locator(LogLocator(base=10, numticks=4))
            ax.yaxis.set_minor_formatter(NullFormatter())
        label = f"{h.name}\n{list(h.shape)} {h.dtype}"
        if h.nonfinite:
            label += f"\n{h.nonfinite} non-finite of {h.numel}"
            ax.set_facecolor("#fde0dd")
        ax.set_title(label, fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _svg(fig, name)


def timeline_svg(rows: Sequence[Mapping[str, Any]], markers: Sequence[Marker],
                 span: tuple[int, int] | None = None) -> str:
    """Alerts and verdicts over steps, one row per signature, coloured by severity; ``span`` is
    the run's first and last step (the x range, so the timeline lines up with the curves)."""
    sigs = list(dict.fromkeys(r["signature"] or r["kind"] for r in rows if isinstance(r["step"], int)))
    caps = [m for m in markers if m.kind == "capture"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(sigs) + 1.6))
    sev = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#2ca02c"}
    for r in rows:
        if isinstance(r["step"], int):
            y = sigs.index(r["signature"] or r["kind"])
            ax.plot(r["step"], y, "D" if r["kind"] == "verdict" else "o",
                    color=sev.get(r["severity"], "#7f7f7f"), ms=8)
    for m in caps:
        ax.axvline(m.step, **_STYLE["capture"])
    ax.set_yticks(range(len(sigs)), sigs, fontsize=8)
    ax.set_ylim(-0.7, max(len(sigs), 1) - 0.3)
    if span is not None and span[1] > span[0]:
        ax.set_xlim(span[0] - 0.5, span[1] + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.set_title("alerts (circles) and replay verdicts (diamonds); red line: capture")
    return _svg(fig, "timeline")


def replay_losses_svg(rebuilt: dict[int, float], recorded: dict[int, float]) -> str:
    """The replay's re-executed loss per step against the loss the run recorded (its evidence)."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    steps = sorted(rebuilt)
    ax.plot(steps, [rebuilt[s] for s in steps], "o-", label="replayed", ms=5)
    rs = [s for s in steps if s in recorded]
    ax.plot(rs, [recorded[s] for s in rs], "x", color="#d62728", ms=8, label="recorded")
    bad = [s for s in steps if not math.isfinite(rebuilt[s])]
    if bad:
        ax.plot(bad, [0.97] * len(bad), "X", color="#d62728", ms=9, transform=ax.get_xaxis_transform(),
                label="non-finite (replayed)")
    _scale(ax, np.array([rebuilt[s] for s in steps] + [recorded[s] for s in rs], dtype=float))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("replay evidence: re-executed loss vs recorded loss")
    return _svg(fig, "replay")
