"""Notification texts: pure functions from a verdict or a replay report to (title, body).

Bodies name the signature, run, rank(s), step, severity, the figures and the method's fix (a replay
verdict's text comes from the one verdict renderer, ``sentineld.contracts.render``).
Nothing here sees a destination URL, so no secret can leak into a message.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from sentineld.contracts.nonfinite import INPUT_REASON
from sentineld.contracts.records import AGENT_ERROR
from sentineld.contracts.render import replay_command

__all__ = ["alert_text", "recovery_text", "replay_failed_text", "agent_notice_text", "nonfinite_causes",
           "CAUSES"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


#: How many likely causes an alert spells out (the rest are named in one line): at 3 am the first
#: few, ordered by what was seen, are what gets read.
SHOWN_CAUSES = 4

#: Likely causes of a non-finite step and their fixes (the method's NaN/Inf table), by key.
CAUSES: dict[str, str] = {
    "lr_nonfinite": "the learning rate itself is non-finite: a scheduler dividing by zero (e.g. a "
                    "warm-up of 0 steps); print scheduler.get_last_lr() at this step and fix its formula",
    "data": "nan/inf in the input batch: check torch.isnan(x).any() / torch.isinf(x).any() in the "
            "data pipeline",
    "div_log": "division by zero or log(0) in the forward (a zero std, an empty count, log of a "
               "probability 0): add eps to the denominator or inside the log, or clamp",
    "lr_large": "learning rate too large (updates overshoot until values overflow): lower it 10x, "
                "add a warm-up",
    "explosion": "gradient explosion (the loss was finite, the gradient norm overflowed): "
                 "torch.nn.utils.clip_grad_norm_ before optimizer.step(), lower the learning rate",
    "grad_zero_div": "0/0 in a gradient (sqrt, norm or pow at 0, or the unselected branch of "
                     "torch.where): mask or clamp the input before the op",
    "fp16": "fp16 overflow (a value over 65504 under autocast): use GradScaler, keep the op in "
            "fp32, or train in bfloat16",
    "optimizer": "the optimizer step made the parameters non-finite (an eps too small for the "
                 "dtype, a custom optimizer's 0/0): check the optimizer's eps and state",
}


def _bad(v: Any) -> bool:
    try:
        return v is not None and not math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def nonfinite_causes(numbers: Mapping[str, Any], message: str = "") -> list[str]:
    """Keys of :data:`CAUSES` ordered by what the first non-finite step showed.

    Args:
        numbers: the ``nonfinite`` verdict's figures (``loss``, ``grad_norm``, ``lr`` when it was
            non-finite); a value may be a float or its string (``"nan"``).
        message: the verdict's message (names ``parameters`` or the ``input batch`` when those went
            non-finite first).

    Returns:
        Every key once: what the figures point at first (a non-finite lr: the scheduler; a finite
        loss with an overflowing gradient norm: explosion; a finite loss and gradient with
        non-finite parameters: the optimizer step), the rest in the method's order.
    """
    loss, gn, lr = numbers.get("loss"), numbers.get("grad_norm"), numbers.get("lr")
    if _bad(lr):
        first = ["lr_nonfinite", "lr_large"]
    elif INPUT_REASON in message:
        first = ["data"]
    elif not _bad(loss) and _bad(gn):
        first = (["grad_zero_div", "explosion", "fp16"] if str(gn).lower() == "nan"
                 else ["explosion", "fp16", "grad_zero_div"])
    elif not _bad(loss) and "parameters" in message:
        first = ["optimizer", "lr_large"]
    elif _bad(loss):
        first = ["div_log", "lr_large", "data", "fp16"]
    else:
        first = []
    default = ["lr_large", "div_log", "explosion", "grad_zero_div", "fp16", "data", "optimizer",
               "lr_nonfinite"]
    return first + [k for k in default if k not in first]


def _fill(fix: str, run: str, replay: str) -> str:
    """The signature's fix with the run's own command for the placeholders it was written with."""
    return fix.replace("sentineld replay <run> --step N", replay).replace("<run>", run)


def alert_text(run: str, ranks: Iterable[int], signature: str, severity: str, step: int,
               message: str, numbers: Mapping[str, Any], fix: str,
               module: str | None = None, host: str = "", run_dir: str | None = None,
               replay_note: str = "") -> tuple[str, str]:
    """Title and body of a signature alert.

    The body names the run id, rank(s), step and figures; for ``nonfinite`` the exact replay
    command (with ``run_dir``, else the run id, and the step) and the likely causes ordered by
    what was seen (:func:`nonfinite_causes`); for other signatures the signature's fix, with any
    ``<run>`` placeholder filled in. ``replay_note`` says whether a replay verdict follows.
    """
    rk = ",".join(str(r) for r in sorted(set(ranks))) or "0"
    where = f" module {module}" if module else ""
    title = f"[sentineld] {severity.upper()} {signature} in run {run} at step {step}"
    figures = ", ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())
    replay = replay_command(run_dir or run, step)
    body = (f"{message}\n"
            f"run: {run}  rank(s): {rk}  step: {step}  severity: {severity}{where}"
            + (f"  host: {host}" if host else "") + "\n"
            + (f"figures: {figures}\n" if figures else ""))
    if signature == "nonfinite":
        body += f"replay step {step}: {replay}\n" + (f"{replay_note}\n" if replay_note else "")
    if signature == "nonfinite" and fix.startswith("Find the first bad step"):  # the generic checklist
        causes = nonfinite_causes(numbers, message)
        shown, rest = causes[:SHOWN_CAUSES], causes[SHOWN_CAUSES:]
        body += ("likely causes, from what was seen:\n"
                 + "".join(f"  {i}. {CAUSES[k]}\n" for i, k in enumerate(shown, 1))
                 + f"  less likely here: {', '.join(CAUSES[k].split(' (')[0].split(':')[0] for k in rest)}\n")
    else:
        body += f"fix: {_fill(fix, run_dir or run, replay)}\n"
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
            f"Run it by hand: {replay_command(run)}\n")


def agent_notice_text(run: str, rank: int, kind: str, step: int, message: str) -> tuple[str, str] | None:
    """Title and body for what the agent reported about itself, or None when it needs no page.

    ``agent_error``: the agent switched itself off, so this run is no longer watched. A warning
    that a capture was not written (a full disk): the incident's replay cannot run.
    """
    at = f" at step {step}" if step >= 0 else ""
    if kind == AGENT_ERROR:
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
