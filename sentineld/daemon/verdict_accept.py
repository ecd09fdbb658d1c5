"""Which verdict files a training process wrote the daemon may hand on (issue 20, item 5).

A run that localizes in process writes ``capture-...verdict.json`` next to its capture, and the
daemon delivers it as the replay's verdict. Anyone who can write into some run dir can write such
a file, so the daemon accepts one only when all of these hold:

- it is a regular file (read through the safe reader: no link, no FIFO, bounded, depth-checked);
- the verdict file, the capture it explains and the run dir are owned by the same user: the one
  training process that made the capture wrote the verdict too (a pre-created run dir of
  another user, or her verdict next to our capture, fails this);
- a report names this run id, this rank and this capture (by file name) and passes the verdict
  schema (:func:`sentineld.contracts.verdict.report_problems`, the one validator), with the
  schema version this daemon reads; a ``{"result": "failed", "reason": ...}`` payload (the
  training process's localization failed) passes the owner rules only.

Anything else is ignored (as if no verdict had been written: the daemon waits, then falls back to
its own replay or says the localization failed) and counted for ``sentineld status``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from sentineld.contracts.rundir import RunMeta, parse_capture_name
from sentineld.contracts.safeio import SafeDir, json_depth_ok
from sentineld.contracts.verdict import PHASES, REPORT_SCHEMA_VERSION, report_problems
from sentineld.contracts.verdict_file import verdict_path

__all__ = ["MAX_VERDICT_BYTES", "verdict_problem", "read_verdict_file", "IgnoredVerdicts"]

log = logging.getLogger("sentineld.daemon")

#: Largest verdict file read (a report is a few KiB; births and evidence stay well under this).
MAX_VERDICT_BYTES = 8 << 20

def verdict_problem(payload: Any, *, owners: tuple[int, int, int], meta: RunMeta, capture: str) -> str | None:
    """Why a verdict may not be delivered, or None when it may (pure: no I/O).

    Args:
        payload: the file's JSON value.
        owners: uids of (run dir, capture, verdict file).
        meta: the run's ``run.json`` as the daemon read it.
        capture: the capture's file name.
    """
    run_uid, cap_uid, file_uid = owners
    if not run_uid == cap_uid == file_uid:
        return (f"owned by uid {file_uid}, its capture by uid {cap_uid} and the run dir by uid "
                f"{run_uid}: not written by the process that made the capture")
    if not isinstance(payload, dict):
        return "not a JSON object"
    if payload.get("result") == "failed" and "phase" not in payload:
        return None if isinstance(payload.get("reason", ""), str) else "a failure whose reason is not text"
    parsed = parse_capture_name(capture)
    if payload.get("schema_version") != REPORT_SCHEMA_VERSION:
        return f"schema_version {payload.get('schema_version')!r}, not {REPORT_SCHEMA_VERSION}"
    if payload.get("run_id") != meta.run_id:
        return f"names run {str(payload.get('run_id'))[:80]!r}, not this run {meta.run_id!r}"
    rank = payload.get("rank")
    if parsed is None or isinstance(rank, bool) or rank != parsed[0]:
        return f"names rank {rank!r}, not the capture's"
    named = payload.get("capture")
    if not isinstance(named, str) or os.path.basename(named) != capture:
        return f"names capture {str(named)[:120]!r}, not {capture}"
    if payload.get("phase") not in PHASES or not isinstance(payload.get("step"), int):
        return "no phase or step of the verdict schema"
    problems = report_problems(payload)
    return "; ".join(problems) if problems else None


def read_verdict_file(meta: RunMeta, capture: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The verdict the training process wrote for ``capture``.

    Returns:
        ``(payload, None)``: accepted; ``(None, None)``: no verdict file yet; ``(None, reason)``:
        a file that is not to be delivered (see the module docstring).
    """
    name = verdict_path(capture).name
    try:
        with SafeDir.open(capture.parent, follow=True) as run:
            cap_st = run.lstat(capture.name)
            with run.open_regular(name) as f:
                file_st = os.fstat(f.fileno())
                data = f.read(MAX_VERDICT_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, str(exc)
    if not stat.S_ISREG(cap_st.st_mode):
        return None, f"its capture {capture.name} is not a regular file"
    if len(data) > MAX_VERDICT_BYTES or not json_depth_ok(data):
        return None, f"over {MAX_VERDICT_BYTES} bytes or nested too deeply"
    try:
        payload = json.loads(data)
    except ValueError:
        return None, "not JSON"
    why = verdict_problem(payload, owners=(run.st.st_uid, cap_st.st_uid, file_st.st_uid), meta=meta,
                          capture=capture.name)
    return (payload, None) if why is None else (None, why)


class IgnoredVerdicts:
    """Verdict files ignored, each counted (and logged) once: ``count`` goes to ``sentineld status``."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def note(self, capture: Path, reason: str) -> None:
        """Count the ignored verdict of ``capture`` (once per file and reason)."""
        key = f"{capture}|{reason}"
        if key in self._seen:
            return
        self._seen.add(key)
        self.count += 1
        log.warning("verdict file for %s ignored: %s", capture, reason)
