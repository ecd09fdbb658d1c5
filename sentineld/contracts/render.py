"""The one renderer of a replay verdict, and the output formats every notification goes out in.

:func:`render_verdict` turns a verdict (a :class:`~sentineld.contracts.verdict.Report` or its JSON)
into ``(title, body)``; the replay's text output (``sentineld replay``), the daemon's notification
and the demo all print that. :func:`format_body` turns any plain-text notification body into the
format a destination takes:

- ``text``: as is, line breaks kept (a terminal, the notifications log, a JSON webhook);
- ``html``: HTML-escaped and pre-formatted (``<pre>``), so ``<run>`` and line breaks survive and
  columns stay aligned in a mail client (apprise derives the email's text/plain part from it);
- ``markdown``: CommonMark with the body in a fenced code block, which apprise translates to
  Slack's mrkdwn (a code block there keeps line breaks and shows ``*`` or ``<`` literally).

Imports no torch, apprise or rich: the daemon, the replay and the agent all use it.
"""

from __future__ import annotations

import html
import math
import os
import re
import shlex
from typing import Any, Mapping

from sentineld.contracts.render_cf import reproducibility_lines, spike_lines, spike_title, what_if_lines

__all__ = ["FORMATS", "render_verdict", "format_body", "tensor_stats_text", "replay_command", "compiled_lines"]

#: Output formats of :func:`format_body` (apprise's ``NotifyFormat`` values).
FORMATS = ("text", "html", "markdown")


def replay_command(run_dir: str, step: int | None = None) -> str:
    """The exact command that replays ``step`` of the run in ``run_dir`` (shell-quoted)."""
    cmd = f"sentineld replay {shlex.quote(str(run_dir))}"
    return cmd if step is None else f"{cmd} --step {step}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def tensor_stats_text(s: Mapping[str, Any] | None) -> str:
    """One tensor's stats (``replay.trace.tensor_stats``) in words: dtype, shape, the range of its
    finite values and its NaN / +Inf / -Inf counts (a finite range alone hides an -inf).

    Example: ``float32[4, 8] finite range [2.343, 2.916], NaN 0, +Inf 0, -Inf 1``.
    """
    if not s:
        return "-"
    shape = s.get("shape")
    out = f"{s.get('dtype')}{list(shape) if shape is not None else ''}"
    if s.get("finite_max_abs") is not None and s.get("min") is not None:
        out += f" finite range [{s['min']:.4g}, {s['max']:.4g}]"
    elif s.get("numel"):
        out += " no finite value"
    if "nan" in s or "posinf" in s or "neginf" in s:
        counts = f"NaN {s.get('nan', 0)}, +Inf {s.get('posinf', 0)}, -Inf {s.get('neginf', 0)}"
        out += f", {counts}" if s.get("nonfinite") or s.get("nan") or s.get("posinf") or s.get("neginf") \
            else ", all finite"
    elif s.get("nonfinite"):
        out += f", {s['nonfinite']} non-finite"
    if s.get("zeros"):  # a zero denominator is the usual 0/0 or x/0
        out += f", {s['zeros']} zeros"
    return out


def _title(r: Mapping[str, Any]) -> str:
    run, step, phase = r.get("run_id", "?"), r.get("step", "?"), r.get("phase", "none")
    module = r.get("module")
    if phase == "none" and (r.get("evidence") or {}).get("mode") == "forward_only":
        # Only the forward was run: "every value finite" would deny the recorded NaN loss.
        return (f"[sentineld] forward-only replay of run {run} step {step}: the model's forward is finite; "
                "loss, backward and optimizer step not checked")
    if phase == "none":
        return f"[sentineld] replay of run {run} step {step}: every value finite"
    ranks = r.get("ranks") or []
    if phase == "data":
        on = f" on rank {', '.join(map(str, ranks))}" if ranks else ""
        return f"[sentineld] replay of run {run} step {step}: non-finite input data{on}"
    where_text = str(r.get("where") or "")
    where = f", module {module}" if module else (
        f", in {where_text}" if where_text.startswith("the ") else f", in the {where_text}" if where_text else "")
    if ranks and phase != "optimizer":  # a data-parallel run: where it was born (an optimizer fault is on all)
        where += f", rank {', '.join(map(str, ranks))}"
    return f"[sentineld] replay of run {run}: step {step} went non-finite in {phase}{where}"


def _module_line(r: Mapping[str, Any]) -> str:
    """``module: fc2 (Linear)``; without a module name (the root module, the loss, the
    optimizer...) the ``where`` says it, once: ``module: the model's own forward (Net)``, not
    ``module: - (Net), the model's own forward (Net)``."""
    module, mtype, where = r.get("module"), r.get("module_type"), str(r.get("where") or "")
    if module:
        return f"module: {module} ({mtype or '-'})"
    if where:
        return f"module: {where}" + (f" ({mtype})" if mtype and mtype not in where else "")
    return f"module: - ({mtype or '-'})"


def _micro_batch(ev: Mapping[str, Any]) -> str | None:
    """``2 of 3`` (1-based) when the step accumulated gradients over several micro-batches (one
    loss per micro-batch in ``micro_losses``); for a data verdict the micro-batch is the first
    index of the field (``batch[1][0]``: the step's batch is the list of its micro-batches)."""
    micro, losses = ev.get("micro_batch"), ev.get("micro_losses") or []
    if micro is None and ev.get("field"):
        m = re.match(r"batch\[(\d+)\]", str(ev["field"]))
        micro = int(m.group(1)) if m else None
    if micro is None or len(losses) < 2:
        return None
    return f"{int(micro) + 1} of {len(losses)}"


def rows_text(rows: list[int]) -> str:
    """Batch row indices for a human: runs of 3+ consecutive rows as ``a..b``, a count when many.

    ``[0, 1, ..., 63]`` printed 64 numbers on one line; it reads ``[0..63] (64 rows)``.
    """
    parts: list[str] = []
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        parts.extend([f"{rows[i]}..{rows[j]}"] if j - i >= 2 else [str(r) for r in rows[i:j + 1]])
        i = j + 1
    text = "[" + ", ".join(parts) + "]"
    return text + (f" ({len(rows)} rows)" if len(rows) > 3 else "")


def _evidence_lines(r: Mapping[str, Any]) -> list[str]:
    ev: Mapping[str, Any] = r.get("evidence") or {}
    out = []
    if r.get("phase") == "data" and ev.get("field"):
        first = (ev.get("fields") or [{}])[0]
        stats = f"  {tensor_stats_text(first['stats'])}" if first.get("stats") else ""
        out.append(f"field: {ev['field']}  samples: {ev.get('samples')}{stats}")
    if ev.get("op_inputs") is not None and r.get("op") and r.get("op") != "lr":
        out.append(f"op inputs: {'; '.join(tensor_stats_text(s) for s in ev['op_inputs']) or '-'}")
        out.append(f"op output: {tensor_stats_text(ev.get('op_output'))}")
        if r.get("phase") in ("forward", "backward") and ev.get("samples"):
            out.append(f"samples: {rows_text(ev['samples'])} (rows of the batch whose output went non-finite here: "
                       "look at these records)")
    if ev.get("state_entry"):
        eps = ev.get("eps")
        out.append(f"optimizer state: {ev['state_entry']}" + (
            f" (eps {eps['eps']:g} is {eps['in_param_dtype']:g} in {eps['param_dtype']})" if eps else ""))
    origin = ev.get("inf_gradient_origin")
    if origin:
        out.append(f"Inf gradient made in backward of module '{origin.get('module')}', op "
                   f"{origin.get('op')} [{origin.get('autograd_node')}]")
    sched = ev.get("scheduler")
    if sched:
        out.append(f"lr used by the step {sched.get('lr_used_by_step')}, set for the next "
                   f"{sched.get('lr_set_for_next_step')} (last_epoch {sched.get('last_epoch')})")
    ddp = ev.get("ddp")
    if isinstance(ddp, Mapping):  # a data-parallel run (replay.ddp)
        tol = r.get("loss_tolerance") or 0.0
        out.append(f"ranks: born on {r.get('ranks') or '-'} of {ddp.get('world_size')}, replayed from "
                   f"{ddp.get('ranks_used')}"
                   + (f", missing {ddp.get('missing_ranks')} (partial)" if ddp.get("partial") else "")
                   + (f", loss tolerance {_fmt(tol)}" if tol else ""))
    if r.get("replayed_as"):  # a sharded (FSDP2) run: consolidated into one process or relaunched
        out.append(f"sharded run replayed {r['replayed_as']}")
        out += _mixed_precision_lines(ev.get("fsdp"))
    forward_only = ev.get("mode") == "forward_only"
    if r.get("phase") == "none":
        out.append(f"recorded run non-finite here: {r.get('recorded_nonfinite')}")
    if ev.get("warning") and not forward_only:  # a forward-only warning says what "not checked" says
        out.append(f"warning: {ev['warning']}")
    if ev.get("not_checked"):  # a forward-only verdict (no loss_fn, no recipe)
        how = ev.get("how_to_enable", "")
        said = how and how in str(r.get("fix") or "")  # each sentence once
        out.append(f"not checked: {', '.join(map(str, ev['not_checked']))}"
                   + ("" if said or not how else f"; to check them, {how}"))
    return out


def render_verdict(report: Any, fmt: str = "text") -> tuple[str, str]:
    """Title and body of a replay verdict.

    Args:
        report: a :class:`~sentineld.contracts.verdict.Report` or its JSON dict (as the replay
            subprocess printed it, non-finite floats possibly as strings).
        fmt: output format of the body, one of :data:`FORMATS` (:func:`format_body`).

    Returns:
        ``(title, body)``: the title names run, step, phase and module; the body has one
        ``label: value`` line per fact (phase, module, op, step, micro-batch under gradient
        accumulation, parameters, reproduction, tensor stats with NaN/+Inf/-Inf counts, cause,
        fix), then the commands to replay, report and regress the run, each on a line of its own.
        The title is plain text in every format (a subject line).

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    r: Mapping[str, Any] = _one_line_names(report if isinstance(report, Mapping) else _as_dict(report))
    if r.get("kind") == "spike":
        return _render_spike(r, fmt)
    step, phase = r.get("step", "?"), r.get("phase", "none")
    node = r.get("autograd_node")
    ev: Mapping[str, Any] = r.get("evidence") or {}
    lines = [
        f"phase: {phase}",
        _module_line(r),
        f"op: {r.get('op') or '-'}" + (f"  autograd node: {node}" if node else ""),
        f"step: {step} (requested {r.get('requested_step', step)})",
    ]
    micro = _micro_batch(ev)
    if micro and phase in ("forward", "backward", "data"):
        lines.append(f"micro-batch: {micro} (gradient accumulation)")
    snap = f"; snapshot at step {ev['snapshot_step']}" if ev.get("snapshot_step") is not None else ""
    lines += [
        f"parameters: {', '.join(r.get('parameters') or []) or '-'}",
        f"reproduced: {r.get('reproduced')} (max loss deviation {_fmt(r.get('max_loss_deviation', 0.0))} "
        f"over {r.get('steps_rebuilt', 0)} rebuilt steps{snap})",
        *_evidence_lines(r),
        *compiled_lines(r),
        f"likely cause: {r.get('cause', '')}",
        f"fix: {r.get('fix', '')}",
        *what_if_lines(r), *reproducibility_lines(r),
    ]
    lines += _commands(r, step)
    return _title(r), format_body("\n".join(lines) + "\n", fmt)


def _render_spike(r: Mapping[str, Any], fmt: str) -> tuple[str, str]:
    """A finite loss spike's verdict (``kind`` spike): :mod:`sentineld.contracts.render_cf`."""
    lines = [*spike_lines(r), *compiled_lines(r), f"likely cause: {r.get('cause', '')}", f"fix: {r.get('fix', '')}",
             *what_if_lines(r), *reproducibility_lines(r), *_commands(r, r.get("step", "?"))]
    return spike_title(r), format_body("\n".join(lines) + "\n", fmt)


def compiled_lines(r: Mapping[str, Any]) -> list[str]:
    """What the eager replay of a ``torch.compile``'d run showed (``compiled``,
    ``eager_reproduced``, ``evidence.compiled``: replay/compiled.py), or nothing for an eager run:
    the backend, that the replay ran eagerly, whether eager made the fault, the tolerance the
    losses were compared under, the note on what to run next, and the compiled re-run's result
    with its repro (or why there is none)."""
    if r.get("compiled") is not True:
        return []
    ev = (r.get("evidence") or {}).get("compiled")
    ev = ev if isinstance(ev, Mapping) else {}
    fault = "loss spike" if r.get("kind") == "spike" else "non-finite value"

    def text(v: Any) -> str:  # evidence of a replay subprocess: one line each, never a forged one
        return _one_line(str(v))[:600]
    out = [f"compiled: backend {text(ev.get('backend') or '-')}, replayed eagerly; eager replay made the run's "
           f"{fault}: {text(r.get('eager_reproduced'))} (loss deviation {text(_fmt(ev.get('max_deviation', 0.0)))}, "
           f"tolerance {text(_fmt(ev.get('tolerance', 0.0)))})"]
    if ev.get("note"):
        out.append(f"compiled note: {text(ev['note'])}")
    rerun = ev.get("compiled_rerun")
    if isinstance(rerun, Mapping):
        got = (f"failed: {text(rerun['error'])}" if rerun.get("error") else
               f"loss {text(_fmt(rerun.get('loss')))}, non-finite: {text(rerun.get('nonfinite'))}")
        out.append(f"compiled re-run ({text(rerun.get('backend'))}): {got}")
        if rerun.get("backend_note"):
            out.append(f"  {text(rerun['backend_note'])}")
        out.append(f"  repro: {text(rerun['repro'])}" if rerun.get("repro") else
                   f"  {text(rerun.get('repro_note') or 'no repro')}")
    return out


def _commands(r: Mapping[str, Any], step: Any) -> list[str]:
    lines: list[str] = []
    if r.get("capture"):  # captures live in the run directory; so does its report
        run_dir = os.path.dirname(str(r["capture"]))
        lines += [f"replay it: {replay_command(run_dir, r.get('requested_step', step))}",
                  f"report: sentineld report {shlex.quote(run_dir)}",
                  f"  writes {os.path.join(run_dir, 'report.html')}",
                  f"regression test: sentineld regress {shlex.quote(run_dir)}"]
    return lines


_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def _one_line(v: str) -> str:
    """``v`` with control characters written as escapes (``\\n``): a module name or run id
    holding a line break would otherwise forge body lines, break out of the markdown fence or
    split an email subject."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), v)


def _seq(v: Any) -> list[str]:
    """A list field as strings: a verdict file from another version or a hand-edited one may
    hold a number or a string where a list belongs (it raised out of the daemon's notifier)."""
    items = v if isinstance(v, (list, tuple)) else ([] if v is None or v == "" else [v])
    return [_one_line(str(x)) for x in items]


def _one_line_names(r: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: _one_line(v) if isinstance(v, str) and k not in ("cause", "fix") else v for k, v in r.items()}
    if "parameters" in out:
        out["parameters"] = _seq(out["parameters"])
    if "ranks" in out:  # ints stay ints (shown as [1, 3]); anything else as one-line text
        raw = out["ranks"] if isinstance(out["ranks"], (list, tuple)) else _seq(out["ranks"])
        out["ranks"] = [x if isinstance(x, int) and not isinstance(x, bool) else _one_line(str(x)) for x in raw]
    if not isinstance(out.get("evidence"), Mapping):
        out["evidence"] = {}
    return out


def _as_dict(report: Any) -> dict[str, Any]:
    from dataclasses import asdict  # noqa: PLC0415

    return asdict(report)


def format_body(body: str, fmt: str) -> str:
    """``body`` (plain text, lines separated by ``\\n``) in output format ``fmt``.

    Args:
        body: a notification body from :func:`render_verdict` or ``sentineld.daemon.messages``.
        fmt: one of :data:`FORMATS`.

    Returns:
        ``text``: ``body``; ``html``: one escaped ``<pre>`` block (line breaks and alignment kept,
        never wrapped: a command stays on one line); ``markdown``: the body in a fenced code block.

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    if fmt == "text":
        return body
    if fmt == "html":
        return ('<pre style="font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; '
                f'white-space: pre; overflow-x: auto">{html.escape(body.rstrip(chr(10)), quote=False)}</pre>\n')
    if fmt == "markdown":
        # Longer than any backtick run in the body: only a fence at least as long closes it
        # (CommonMark), so no line of the body can end the code block early.
        fence = "`" * max(3, 1 + max((len(m) for m in re.findall("`+", body)), default=0))
        return f"{fence}\n{body.rstrip(chr(10))}\n{fence}\n"
    raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _mixed_precision_lines(fsdp: Any) -> list[str]:
    """The text verdict's lines on an FSDP2 run's mixed precision (evidence ``fsdp``)."""
    if not isinstance(fsdp, Mapping):
        return []
    out = []
    mixed = fsdp.get("mixed_precision") or []
    if mixed:
        pols = sorted({f"param {u.get('param_dtype') or 'as stored'}, reduce {u.get('reduce_dtype') or 'as param'}"
                       for u in mixed if isinstance(u, Mapping)})
        units = ", ".join(str(u.get("module") or "<root>") for u in mixed if isinstance(u, Mapping))
        if fsdp.get("state") == "relaunched":
            out.append(f"mixed precision: applied as the run had it ({'; '.join(pols)}) on units {units}")
        else:
            out.append(f"mixed precision: the run computed units {units} with {'; '.join(pols)}; this consolidated "
                       "replay computes in the parameters' dtype, so its losses are not the run's: "
                       f"{fsdp.get('relaunch')} applies the policies")
    if fsdp.get("units_problem"):
        out.append(f"warning: {fsdp['units_problem']}")
    return out
