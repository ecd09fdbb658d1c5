"""What a report shows, as plain data, and the pure functions that derive it from a run's records.

Nothing here reads files or imports torch: :mod:`sentineld.report.sources` reads the run directory
through the project's readers and hands lists of :class:`~sentineld.contracts.records.StepRecord` and
:class:`~sentineld.daemon.outbox.Notification` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from sentineld.contracts.records import StepRecord
from sentineld.daemon.outbox import Notification

__all__ = ["Curves", "LayerGrid", "Marker", "Hist", "ReportData", "curves", "layer_grid",
           "dead_or_saturated_grid", "alert_markers", "alert_rows", "capture_markers", "thin_indices", "hist",
           "MAX_POINTS", "MAX_COLUMNS", "MAX_HISTS"]

#: Most points per curve drawn; longer runs are thinned by a stride, keeping every non-finite
#: step (an SVG of a million points is tens of MB and the eye cannot see them anyway).
MAX_POINTS = 4000
#: Most step columns of a heatmap (sampled steps beyond that are thinned the same way).
MAX_COLUMNS = 400
#: Most module rows of a heatmap: modules with a NaN/Inf come first, then model order.
MAX_ROWS = 48

#: Parameters (weights) and modules (activations) drawn as histograms, in model order.
MAX_HISTS = 12


@dataclass(frozen=True)
class Curves:
    """Per-step scalars, aligned: ``steps[i]`` has ``loss[i]``, ``grad_norm[i]``, ``lr[i]``.

    Missing values (no gradient, no learning rate) are NaN in the arrays and flagged False in
    ``*_present``; non-finite values the run produced are NaN/Inf with ``*_present`` True.
    """

    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    lr: np.ndarray
    grad_norm_present: np.ndarray
    lr_present: np.ndarray


@dataclass(frozen=True)
class LayerGrid:
    """A per-module statistic over sampled steps: ``values[i, j]`` of module ``modules[i]`` at
    ``steps[j]``; NaN where the module had no value at that step (``missing`` True) or where the
    value itself was non-finite (``missing`` False)."""

    name: str
    modules: list[str]
    steps: np.ndarray
    values: np.ndarray
    missing: np.ndarray
    total_modules: int = 0


@dataclass(frozen=True)
class Marker:
    """A vertical marker on the step axis: a capture (incident) or an alert."""

    step: int
    kind: str
    label: str
    severity: str = ""


@dataclass(frozen=True)
class Hist:
    """Finite values of one tensor for a histogram, with what was left out.

    Attributes:
        name: parameter or module name.
        values: finite values (float64, 1-D; at most ``limit`` of them, an even stride).
        numel: elements of the tensor; nonfinite: how many were NaN/Inf; shape, dtype: of the tensor.
    """

    name: str
    values: np.ndarray
    numel: int
    nonfinite: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class ReportData:
    """Everything one report shows (filled by :func:`sentineld.report.sources.gather`)."""

    run_id: str
    run_dir: str
    rank: int
    meta: dict[str, Any]
    curves: Curves
    grids: list[LayerGrid]
    markers: list[Marker]
    alerts: list[Notification]
    capture: dict[str, Any] | None = None
    weights: list[Hist] = field(default_factory=list)
    activations: list[Hist] = field(default_factory=list)
    activations_note: str = ""
    verdict: dict[str, Any] | None = None
    verdict_note: str = ""
    notes: list[str] = field(default_factory=list)


def thin_indices(n: int, keep: np.ndarray | None, limit: int) -> np.ndarray:
    """Indices ``0..n-1`` thinned to about ``limit`` by an even stride, plus every ``keep`` index.

    Args:
        n: number of points; keep: boolean mask of length n of points that must stay (non-finite).
        limit: most points by stride (the kept ones come on top).
    """
    if n <= limit:
        return np.arange(n)
    idx = np.arange(0, n, math.ceil(n / limit))
    if keep is not None and keep.any():
        idx = np.union1d(idx, np.flatnonzero(keep))
    return np.union1d(idx, [n - 1])


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def curves(records: Sequence[StepRecord], limit: int = MAX_POINTS) -> Curves:
    """Loss, grad norm and learning rate per step, sorted by step (the last record of a step wins,
    as after a restart), thinned to about ``limit`` points keeping every non-finite one."""
    by_step = {r.step: r for r in records}
    steps = np.array(sorted(by_step), dtype=np.int64)
    rs = [by_step[int(s)] for s in steps]
    loss = np.array([_num(r.loss) for r in rs], dtype=np.float64)
    gn = np.array([_num(r.grad_norm) for r in rs], dtype=np.float64)
    lr = np.array([_num(r.lr) for r in rs], dtype=np.float64)
    gp = np.array([r.grad_norm is not None for r in rs], dtype=bool)
    lp = np.array([r.lr is not None for r in rs], dtype=bool)
    bad = ~np.isfinite(loss) | (gp & ~np.isfinite(gn)) | (lp & ~np.isfinite(lr))
    i = thin_indices(len(steps), bad, limit)
    return Curves(steps[i], loss[i], gn[i], lr[i], gp[i], lp[i])


def layer_grid(records: Sequence[StepRecord], stat: str, limit: int = MAX_COLUMNS,
               max_rows: int = MAX_ROWS) -> LayerGrid:
    """``stat`` (a :class:`~sentineld.contracts.records.LayerStats` field) per module over the sampled steps.

    Modules keep the order the agent reported them in (module order of the model); only modules
    with at least one value of ``stat`` appear, at most ``max_rows`` of them (those with a NaN/Inf
    first); ``total_modules`` counts them all.
    """
    sampled = [r for r in records if r.layers]
    modules: list[str] = []
    for r in sampled:
        for name, st in (r.layers or {}).items():
            if getattr(st, stat) is not None and name not in modules:
                modules.append(name)
    steps = np.array([r.step for r in sampled], dtype=np.int64)
    vals = np.full((len(modules), len(sampled)), np.nan)
    missing = np.ones_like(vals, dtype=bool)
    for j, r in enumerate(sampled):
        for i, m in enumerate(modules):
            cell = (r.layers or {}).get(m)
            v = None if cell is None else getattr(cell, stat)
            if v is not None:
                vals[i, j], missing[i, j] = _num(v), False
    bad = ~np.isfinite(vals) & ~missing
    keep = bad.any(axis=0) if len(modules) else None
    idx = thin_indices(len(sampled), keep, limit)
    rows = np.arange(len(modules))
    if len(modules) > max_rows:
        first = np.flatnonzero(bad.any(axis=1))[:max_rows]
        rest = np.setdiff1d(rows, first)[: max_rows - len(first)]
        rows = np.union1d(first, rest)  # back in model order
    return LayerGrid(stat, [modules[i] for i in rows], steps[idx], vals[np.ix_(rows, idx)],
                     missing[np.ix_(rows, idx)], len(modules))


def dead_or_saturated_grid(records: Sequence[StepRecord], limit: int = MAX_COLUMNS) -> LayerGrid:
    """One grid of the share (0-1) of dead units (ReLU family) or saturated units (Tanh, Sigmoid)
    per activation module; a module reports one of the two (see ``agent/probes.py``). At a step
    whose loss is non-finite the shares are marked non-finite: NaN activations count as neither
    positive nor unsaturated, so the agent's shares read 100 % there, which is not a dead layer."""
    grid = _dead_or_saturated(records, limit)
    bad_steps = {r.step for r in records if not math.isfinite(_num(r.loss))}
    cols = np.isin(grid.steps, sorted(bad_steps))
    if cols.any() and grid.values.size:
        vals = grid.values.copy()
        vals[:, cols] = np.where(grid.missing[:, cols], vals[:, cols], np.nan)
        grid = LayerGrid(grid.name, grid.modules, grid.steps, vals, grid.missing, grid.total_modules)
    return grid


def _dead_or_saturated(records: Sequence[StepRecord], limit: int) -> LayerGrid:
    dead = layer_grid(records, "dead_fraction", limit)
    sat = layer_grid(records, "saturated_fraction", limit)
    if not sat.modules:
        return LayerGrid("dead_or_saturated", [f"{m} (dead)" for m in dead.modules], dead.steps,
                         dead.values, dead.missing, dead.total_modules)
    if not dead.modules:
        return LayerGrid("dead_or_saturated", [f"{m} (saturated)" for m in sat.modules], sat.steps,
                         sat.values, sat.missing, sat.total_modules)
    # Both: the same records were thinned the same way, so the step columns match.
    names = [f"{m} (dead)" for m in dead.modules] + [f"{m} (saturated)" for m in sat.modules]
    return LayerGrid("dead_or_saturated", names, dead.steps, np.vstack([dead.values, sat.values]),
                     np.vstack([dead.missing, sat.missing]), dead.total_modules + sat.total_modules)


def alert_markers(notes: Iterable[Notification]) -> list[Marker]:
    """A marker per alert and verdict notification that names a step, oldest step first."""
    out = [Marker(int(n.step), n.kind, n.signature or n.kind, n.severity)
           for n in notes if n.kind in ("alert", "verdict") and isinstance(n.step, int)]
    return sorted(out, key=lambda m: (m.step, m.label))


def capture_markers(captures: Iterable[tuple[int, int, str, Any]], rank: int) -> list[Marker]:
    """A marker per capture of ``rank`` (``(rank, step, trigger, path)`` as from ``list_captures``)."""
    return [Marker(step, "spike" if trigger == "spike" else "capture", f"capture ({trigger})",
                   "critical" if trigger == "nonfinite" else "")
            for r, step, trigger, _p in captures if r == rank]


def hist(name: str, arr: np.ndarray, dtype: str, limit: int = 200_000) -> Hist:
    """A :class:`Hist` of ``arr`` (any shape; converted to float64), at most ``limit`` values."""
    flat = np.asarray(arr, dtype=np.float64).reshape(-1)
    finite = np.isfinite(flat)
    vals = flat[finite]
    if vals.size > limit:
        vals = vals[:: math.ceil(vals.size / limit)]
    return Hist(name, vals, int(flat.size), int(flat.size - finite.sum()), tuple(np.shape(arr)), dtype)


def alert_rows(notes: Iterable[Notification]) -> list[Mapping[str, Any]]:
    """The alert timeline's table rows (created time, kind, severity, signature, step, title)."""
    rows = [{"created_s": n.created_s, "kind": n.kind, "severity": n.severity, "signature": n.signature,
             "step": n.step, "title": n.title, "delivered": n.delivered_s is not None}
            for n in notes]
    return sorted(rows, key=lambda r: (r["created_s"], str(r["step"])))
