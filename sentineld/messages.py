"""Notification texts: pure functions from a verdict or a replay report to (title, body).

Bodies name the signature, run, rank(s), step, severity, the figures and the method's fix; a
replay verdict names phase, module, op and parameters. Nothing here sees a destination URL, so no
secret can leak into a message.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping

__all__ = ["alert_text", "recovery_text", "verdict_text", "replay_failed_text"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def alert_text(run: str, ranks: Iterable[int], signature: str, severity: str, step: int,
               message: str, numbers: Mapping[str, Any], fix: str,
               module: str | None = None, host: str = "") -> tuple[str, str]:
    """Title and body of a signature alert."""
    rk = ",".join(str(r) for r in sorted(set(ranks))) or "0"
    where = f" module {module}" if module else ""
    title = f"[sentineld] {severity.upper()} {signature} in run {run} at step {step}"
    figures = ", ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())
    body = (f"{message}\n"
            f"run: {run}  rank(s): {rk}  step: {step}  severity: {severity}{where}"
            + (f"  host: {host}" if host else "") + "\n"
            + (f"figures: {figures}\n" if figures else "")
            + f"fix: {fix}\n")
    return title, body


def recovery_text(run: str, signature: str, step: int, module: str | None = None) -> tuple[str, str]:
    """Title and body of the notice that a signature cleared."""
    where = f" (module {module})" if module else ""
    title = f"[sentineld] RESOLVED {signature} in run {run}"
    return title, f"{signature}{where} no longer fires in run {run} as of step {step}.\n"


def verdict_text(report: Mapping[str, Any]) -> tuple[str, str]:
    """Title and body of a replay verdict (``report`` is the replay's JSON)."""
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
    if report.get("capture"):  # captures live in the run directory; so does its report
        run_dir = os.path.dirname(str(report["capture"]))
        lines.append(f"report: write it with `sentineld report {run_dir}` "
                     f"(to {os.path.join(run_dir, 'report.html')}); a regression test with "
                     f"`sentineld regress {run_dir}`")
    return title, "\n".join(lines) + "\n"


def replay_failed_text(run: str, capture: str, reason: str) -> tuple[str, str]:
    """Title and body when a replay could not give a verdict (timeout, crash, bad input)."""
    return (f"[sentineld] replay of run {run} failed",
            f"The replay of {capture} gave no verdict: {reason}\n"
            f"Run it by hand: sentineld replay {run}\n")
