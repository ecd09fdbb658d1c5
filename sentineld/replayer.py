"""Running a replay as a subprocess: the run's interpreter and working directory, bounded in time
and memory.

The replay imports the user's model code, which can hang, eat memory or crash; it therefore runs
in its own process group under ``RLIMIT_AS`` and a timeout, and the daemon only reads its JSON.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rundir import RunMeta

__all__ = ["ReplayOutcome", "run_replay_subprocess"]


@dataclass
class ReplayOutcome:
    """What a replay subprocess gave.

    Attributes:
        result: ``localized`` | ``not_localized`` | ``not_reproduced`` | ``failed`` | ``timeout``.
        report: the replay's JSON report (None unless it printed one).
        reason: why it failed (stderr tail, timeout) for ``failed``/``timeout``.
        elapsed_s: wall seconds.
        exit_code: the subprocess's exit status (None on timeout).
    """

    result: str
    report: dict[str, Any] | None
    reason: str
    elapsed_s: float
    exit_code: int | None


def _limits(memory_bytes: int) -> Any:
    def apply() -> None:
        if memory_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return apply


def run_replay_subprocess(meta: RunMeta, run_dir: Path, capture: Path, *, timeout_s: float,
                          memory_bytes: int) -> ReplayOutcome:
    """Run ``python -m sentineld.replay RUN --capture CAP --json`` and classify the outcome.

    The interpreter is the run's own (``meta.python``) when it exists on this host, else this
    daemon's; the working directory is the run's (where its recipe module lives).
    """
    python = meta.python if meta.python and Path(meta.python).exists() else sys.executable
    cwd = meta.cwd if meta.cwd and Path(meta.cwd).is_dir() else str(run_dir)
    cmd = [python, "-m", "sentineld.replay", str(run_dir), "--capture", str(capture), "--json"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_limits(memory_bytes), env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return ReplayOutcome("timeout", None, f"no verdict within {timeout_s:g} s (killed)",
                             time.monotonic() - t0, None)
    elapsed = time.monotonic() - t0
    report = None
    try:
        parsed = json.loads(out.decode(errors="replace"))
        report = parsed if isinstance(parsed, dict) else None
    except ValueError:
        pass
    tail = err.decode(errors="replace").strip().splitlines()[-5:]
    if report is None:
        why = " | ".join(tail) or f"exit code {proc.returncode}"
        if proc.returncode is not None and proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} (memory limit?) {why}"
        return ReplayOutcome("failed", None, why, elapsed, proc.returncode)
    if not report.get("reproduced", False):
        result = "not_reproduced"
    elif report.get("phase") == "none":
        result = "not_localized"
    else:
        result = "localized"
    return ReplayOutcome(result, report, "", elapsed, proc.returncode)
