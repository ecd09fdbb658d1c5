"""The replay's verdict: its schema (:class:`Report`, a JSON-ready record) and its two text forms,
both here: :func:`render_text` for a person at a terminal (``sentineld replay``), with the evidence,
and :func:`notification_text` for the daemon's notification (what the demo prints).

JSON fields (stable; ``schema_version`` bumps on any change): ``schema_version``, ``run_id``,
``rank``, ``step`` (the offending step), ``requested_step``, ``phase`` (``data`` | ``forward`` |
``backward`` | ``optimizer`` | ``none``), ``module``, ``module_type``, ``op``, ``autograd_node``,
``parameters``, ``reproduced``, ``max_loss_deviation``, ``steps_rebuilt``, ``recorded_nonfinite``,
``cause``, ``fix``, ``evidence``, ``capture``, ``elapsed_s``, ``rebuild_s`` (loading the capture and
re-executing S..N-1), ``localize_s`` (the instrumented step); a data-parallel run's replay adds
``ranks`` (the ranks where the first non-finite value was born; every rank for an optimizer-step
fault) and ``loss_tolerance`` (largest accepted |rebuilt - recorded| loss; 0 = bit for bit).

``evidence`` keys by phase: ``data``: ``field``, ``samples``, ``fields``; ``forward``:
``op_inputs``, ``op_output``, ``module_call``, ``first_nonfinite_module``, ``micro_batch``;
``backward``: ``op_inputs``, ``op_output``; ``optimizer``: ``state_entry``, ``optimizer_state``,
``eps``, ``inf_gradient_origin`` (clipping), ``scheduler`` (learning rate); always
``replayed_loss``, ``recorded_loss``, ``rebuilt_losses``, ``births``, ``nan_table_row``,
``precision``, ``torch_flags``; a verdict of the training process itself (``attach(loss_fn=)``,
:mod:`sentineld.contracts.verdict_file`) adds ``in_process`` (``mode``, ``memory_bytes``, ``wall_s``),
and a forward-only one ``not_checked`` (phases it could not check) and ``how_to_enable``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = ["REPORT_SCHEMA_VERSION", "Report", "render_text", "notification_text"]

REPORT_SCHEMA_VERSION = 1


@dataclass
class Report:
    """Where the first non-finite value of a run was made, with the evidence."""

    run_id: str
    rank: int
    step: int
    requested_step: int
    phase: str
    module: str | None = None
    module_type: str | None = None
    op: str | None = None
    autograd_node: str | None = None
    parameters: list[str] = field(default_factory=list)
    reproduced: bool = False
    max_loss_deviation: float = 0.0
    steps_rebuilt: int = 0
    recorded_nonfinite: bool = False
    cause: str = ""
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    capture: str = ""
    elapsed_s: float = 0.0
    rebuild_s: float = 0.0
    localize_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    loss_tolerance: float = 0.0
    schema_version: int = REPORT_SCHEMA_VERSION

    def to_json(self) -> str:
        """Strict JSON (non-finite floats become strings such as ``"nan"``)."""
        return json.dumps(_strict(asdict(self)), indent=2, sort_keys=True)


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _stats(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    bad = f", {s['nonfinite']} non-finite" if s.get("nonfinite") else ""
    rng = (f" [{s['min']:.4g}, {s['max']:.4g}] max|x| {s['finite_max_abs']:.4g}"
           if s.get("finite_max_abs") is not None else "")
    return f"{s.get('dtype')}{s.get('shape')}{rng}{bad}"


def _details(r: Report) -> list[str]:
    ev = r.evidence
    out = []
    if r.phase == "data":
        out.append(f"field {ev.get('field')}, samples {ev.get('samples')}")
    if ev.get("op_inputs") is not None and r.op and r.op != "lr":
        out.append(f"op inputs: {'; '.join(_stats(s) for s in ev['op_inputs']) or '-'}")
        out.append(f"op output: {_stats(ev.get('op_output'))}")
    if ev.get("state_entry"):
        out.append(f"optimizer state: {ev['state_entry']}" + (
            f" (eps {ev['eps']['eps']:g} is {ev['eps']['in_param_dtype']:g} in {ev['eps']['param_dtype']})"
            if ev.get("eps") else ""))
    origin = ev.get("inf_gradient_origin")
    if origin:
        out.append(f"Inf gradient made in backward of module '{origin.get('module')}', op {origin.get('op')} "
                   f"[{origin.get('autograd_node')}]")
    sched = ev.get("scheduler")
    if sched:
        out.append(f"lr used by the step {sched.get('lr_used_by_step')}, set for the next "
                   f"{sched.get('lr_set_for_next_step')} (last_epoch {sched.get('last_epoch')})")
    ddp = ev.get("ddp")
    if isinstance(ddp, dict):  # a data-parallel run (replay.ddp)
        out.append(f"ranks: born on {r.ranks or '-'} of {ddp.get('world_size')}, replayed from {ddp.get('ranks_used')}"
                   + (f", missing {ddp['missing_ranks']} (partial)" if ddp.get("partial") else "")
                   + (f", loss tolerance {r.loss_tolerance:.3g}" if r.loss_tolerance else ""))
    if r.phase == "none":
        out.append(f"recorded run non-finite here: {r.recorded_nonfinite}")
    if ev.get("warning"):
        out.append(f"warning: {ev['warning']}")
    return out


def render_text(r: Report) -> str:
    """One short paragraph a person reads first, then the key evidence."""
    where = ""
    if r.module is not None:
        where = f" in module '{r.module}' ({r.module_type})"
    op = f", op {r.op}" if r.op else ""
    node = f" [{r.autograd_node}]" if r.autograd_node else ""
    params = f"\n  parameters: {', '.join(r.parameters[:8])}" if r.parameters else ""
    repro = ("reproduced bit for bit" if r.reproduced and r.max_loss_deviation == 0
             else f"reproduced (max loss deviation {r.max_loss_deviation:.3g})" if r.reproduced
             else f"NOT reproduced (max loss deviation {r.max_loss_deviation:.3g})")
    if r.phase == "none":
        head = f"step {r.step}: replay found every value finite"
    elif r.phase == "data":
        head = f"step {r.step}: the batch holds non-finite values ({r.evidence.get('field', '?')})"
    else:
        head = f"step {r.step}: first non-finite value made in {r.phase}{where}{op}{node}"
    details = "".join(f"\n  {d}" for d in _details(r))
    return (f"{head}\n  {repro} over {r.steps_rebuilt} rebuilt steps (snapshot at step "
            f"{r.evidence.get('snapshot_step', '?')}){params}{details}\n"
            f"  likely cause: {r.cause}\n  fix: {r.fix}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def notification_text(report: Mapping[str, Any]) -> tuple[str, str]:
    """Title and body of the daemon's notification of a verdict (``report`` is its JSON, as the
    replay subprocess printed it)."""
    run, step, phase = report.get("run_id", "?"), report.get("step", "?"), report.get("phase", "none")
    module, mtype, op = report.get("module"), report.get("module_type"), report.get("op")
    if phase == "none":
        title = f"[sentineld] replay of run {run} step {step}: every value finite"
    elif phase == "data":
        title = f"[sentineld] replay of run {run} step {step}: non-finite input data"
    else:
        title = (f"[sentineld] replay of run {run}: step {step} went non-finite in {phase}"
                 + (f", module {module}" if module else ""))
    lines = [
        f"phase: {phase}",
        f"module: {module or '-'} ({mtype or '-'})",
        f"op: {op or '-'}" + (f"  autograd node: {report['autograd_node']}" if report.get("autograd_node") else ""),
        f"step: {step} (requested {report.get('requested_step', step)})",
        f"parameters: {', '.join(report.get('parameters') or []) or '-'}",
        f"reproduced: {report.get('reproduced')} (max loss deviation "
        f"{_fmt(report.get('max_loss_deviation', 0.0))} over {report.get('steps_rebuilt', 0)} rebuilt steps)",
        f"likely cause: {report.get('cause', '')}",
        f"fix: {report.get('fix', '')}",
    ]
    ev = report.get("evidence") or {}
    if phase == "data" and ev.get("field"):
        lines.append(f"field: {ev['field']} samples: {ev.get('samples')}")
    if ev.get("not_checked"):  # a forward-only verdict (no loss_fn, no recipe)
        lines.append(f"not checked: {', '.join(map(str, ev['not_checked']))}; to check them, "
                     f"{ev.get('how_to_enable', '')}")
    if report.get("capture"):  # captures live in the run directory; so does its report
        run_dir = os.path.dirname(str(report["capture"]))
        lines.append(f"report: write it with `sentineld report {run_dir}` "
                     f"(to {os.path.join(run_dir, 'report.html')}); a regression test with "
                     f"`sentineld regress {run_dir}`")
    return title, "\n".join(lines) + "\n"
