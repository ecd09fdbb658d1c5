"""Notification texts: pure functions from a verdict or a replay report to (title, body).

Bodies name the signature, run, rank(s), step, severity, the figures and the method's fix (a replay
verdict's text is rendered next to its schema: ``sentineld.contracts.verdict.notification_text``).
Nothing here sees a destination URL, so no secret can leak into a message.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

__all__ = ["alert_text", "recovery_text", "replay_failed_text"]


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


def replay_failed_text(run: str, capture: str, reason: str) -> tuple[str, str]:
    """Title and body when a replay could not give a verdict (timeout, crash, bad input)."""
    return (f"[sentineld] replay of run {run} failed",
            f"The replay of {capture} gave no verdict: {reason}\n"
            f"Run it by hand: sentineld replay {run}\n")


def agent_notice_text(run: str, rank: int, kind: str, step: int, message: str) -> tuple[str, str] | None:
    """Title and body for what the agent reported about itself, or None when it needs no page.

    ``agent_error``: the agent switched itself off, so this run is no longer watched. A warning
    that a capture was not written (a full disk): the incident's replay cannot run.
    """
    at = f" at step {step}" if step >= 0 else ""
    if kind == "agent_error":
        return (f"[sentineld] monitoring stopped in run {run} (rank {rank})",
                f"The agent in run {run}, rank {rank}, switched itself off{at}: {message}\n"
                "Training goes on unwatched: no more alerts or captures for this rank. Fix the cause "
                "and restart the run to watch it again.\n")
    if message.startswith("capture not written"):
        return (f"[sentineld] capture failed in run {run}{at}",
                f"Run {run}, rank {rank}: the capture{at} was not written: {message}\n"
                "Without it the offending step cannot be replayed. Free space in the runs dir "
                "(a full disk is the usual cause); the next incident will be captured.\n")
    return None
