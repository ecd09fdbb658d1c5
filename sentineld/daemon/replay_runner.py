"""Running a replay as a subprocess: the run's interpreter and working directory, bounded in time,
memory and output.

The replay imports the user's model code, which can hang, eat memory, flood its output or crash;
it therefore runs in its own process group under ``RLIMIT_AS``, is killed (the whole group) after
the timeout, writes its output to files of which only a bounded head/tail is read, dies with the
daemon (``PR_SET_PDEATHSIG`` on Linux, so a SIGKILLed daemon leaves no orphan replay), and gets
the daemon's environment without the notification settings (URLs may hold secrets).

Trust (docs/reliability.md): nothing runs unless the run dir, ``run.json``, the capture and the
interpreter ``run.json`` names are ours (:mod:`sentineld.contracts.trust`); the interpreter starts isolated
(``-I``: neither the working directory nor ``$PYTHONPATH`` on ``sys.path``, so a ``click.py``
planted there cannot run before any check); and only output shaped like a replay verdict of this
run is taken as one.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sentineld.contracts.rundir import RunMeta
from sentineld.contracts.trust import REPLAY_PATH_ENV, UntrustedError, check_interpreter, untrusted_reason

__all__ = ["ReplayOutcome", "run_replay_subprocess", "SCRUBBED_ENV"]

#: Environment variables the replay subprocess never sees (they may hold secrets).
SCRUBBED_ENV = ("SENTINELD_NOTIFY", "SENTINELD_ALERTMANAGER_URL", "SENTINELD_CONFIG")

#: Most bytes of the replay's stdout read back (its JSON verdict is a few KiB).
MAX_STDOUT_BYTES = 8 << 20


@dataclass
class ReplayOutcome:
    """What a replay subprocess gave.

    Attributes:
        result: ``localized`` | ``not_localized`` | ``not_reproduced`` | ``failed`` | ``timeout`` |
            ``refused`` (a file that names the code to run is not trusted: nothing was executed) |
            ``no_recipe`` (the run gave no recipe; set by the daemon, :mod:`sentineld.daemon.am_incident`).
        report: the replay's JSON report (None unless it printed one).
        reason: why it failed (stderr tail, timeout, memory limit) for ``failed``/``timeout``.
        elapsed_s: wall seconds.
        exit_code: the subprocess's exit status (None on timeout).
    """

    result: str
    report: dict[str, Any] | None
    reason: str
    elapsed_s: float
    exit_code: int | None


try:  # resolved here, not in the forked child
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _limits(memory_bytes: int) -> Any:
    def apply() -> None:
        if memory_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        if _prctl is not None:  # die with the daemon thread that started us: no orphan replay
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return apply


def _tail(f: Any, n_bytes: int = 4000) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - n_bytes))
    return f.read().decode(errors="replace")


def _memory_hint(text: str) -> bool:
    return any(s in text for s in ("MemoryError", "can't allocate memory", "Cannot allocate memory",
                                   "std::bad_alloc", "DefaultCPUAllocator"))


#: The replay verdict's phases (replay/report.py); anything else is not a verdict.
VERDICT_PHASES = ("data", "forward", "backward", "optimizer", "none")


def refusal(meta: RunMeta, run_dir: Path, capture: Path) -> tuple[str, str]:
    """Whether the daemon may start a replay of this run: ``(python, "")`` or ``("", reason)``.

    ``python`` is the interpreter to use (``meta.python`` if it exists, else this daemon's own).
    Pure apart from ``stat`` calls.
    """
    reason = untrusted_reason([run_dir, run_dir / "run.json", capture])
    if reason:
        return "", f"refused: the run's files are not trusted ({reason})"
    python = meta.python if meta.python and Path(meta.python).exists() else sys.executable
    try:
        check_interpreter(python)
    except (UntrustedError, OSError) as exc:
        return "", f"refused: the interpreter run.json names is not trusted ({exc})"
    return python, ""


def is_verdict(report: Any, run_id: str) -> bool:
    """True when ``report`` has the shape of a replay verdict of run ``run_id`` (replay/report.py)."""
    return (isinstance(report, dict) and isinstance(report.get("schema_version"), int)
            and report.get("phase") in VERDICT_PHASES and isinstance(report.get("reproduced"), bool)
            and report.get("run_id") == run_id and isinstance(report.get("step"), int))


def run_replay_subprocess(meta: RunMeta, run_dir: Path, capture: Path, *, timeout_s: float,
                          memory_bytes: int, scratch_dir: Path | None = None,
                          what_if: bool = False) -> ReplayOutcome:
    """Run ``python -I -m sentineld.replay RUN --capture CAP --json`` and classify the outcome.

    The interpreter is the run's own (``meta.python``) when it exists on this host, else this
    daemon's; the working directory is the run's (where its recipe module lives). Nothing is
    started when a file naming code is untrusted (result ``refused``, see :func:`refusal`).

    Args:
        timeout_s: seconds before the replay's process group is killed (result ``timeout``).
        memory_bytes: ``RLIMIT_AS`` of the replay in bytes; 0 = none. A replay that exceeds it
            fails with a reason naming the limit.
        scratch_dir: where its output files go (deleted after); default the system temp dir.
        what_if: pass ``--what-if`` (candidate fixes and the reproducibility class).
    """
    python, why_not = refusal(meta, run_dir, capture)
    if why_not:
        return ReplayOutcome("refused", None, why_not, 0.0, None)
    cwd = meta.cwd if meta.cwd and Path(meta.cwd).is_dir() else str(run_dir)
    # -I: the working directory (another user may write there) is not on sys.path, nor is
    # $PYTHONPATH; the replay adds the working directory itself, behind its import guard.
    cmd = [python, "-I", "-m", "sentineld.replay", str(run_dir), "--capture", str(capture), "--json"]
    if what_if:
        cmd.append("--what-if")
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    # -I drops $PYTHONPATH; the daemon's own (its user's choice, not the run's) is handed over
    # apart, and the replay puts it on sys.path only after checking every entry like the rest.
    env[REPLAY_PATH_ENV] = os.environ.get("PYTHONPATH", "")
    t0 = time.monotonic()
    with tempfile.TemporaryFile(dir=scratch_dir) as out_f, tempfile.TemporaryFile(dir=scratch_dir) as err_f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_limits(memory_bytes), env=env)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return ReplayOutcome("timeout", None, f"no verdict within {timeout_s:g} s (killed)",
                                 time.monotonic() - t0, None)
        finally:
            try:  # anything the replay left in its process group goes too
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        elapsed = time.monotonic() - t0
        out_f.seek(0)
        out = out_f.read(MAX_STDOUT_BYTES)
        err_text = _tail(err_f)
    report, parsed = None, None
    try:
        parsed = json.loads(out.decode(errors="replace"))
        report = parsed if is_verdict(parsed, meta.run_id) else None
    except (ValueError, RecursionError):
        pass
    tail = err_text.strip().splitlines()[-5:]
    if report is None:
        why = " | ".join(tail) or f"exit code {proc.returncode}"
        if parsed is not None:  # never deliver what merely parses as JSON as a verdict
            why = f"its output is not a replay verdict of run {meta.run_id}; {why}"
        limit = f"{memory_bytes / 2**30:.3g} GiB address space" if memory_bytes > 0 else "none"
        if memory_bytes > 0 and _memory_hint(err_text):
            why = f"exceeded the replay memory limit ({limit}; replay_memory_bytes): {why}"
        elif proc.returncode is not None and proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} (memory limit {limit}): {why}"
        return ReplayOutcome("failed", None, why[-1500:], elapsed, proc.returncode)
    if report.get("kind") == "spike":  # a finite loss spike's verdict names a cause, not a phase
        result = "not_reproduced" if report.get("cause_class") == "not_reproduced" else "localized"
    elif not report.get("reproduced", False):
        result = "not_reproduced"
    elif report.get("phase") == "none":
        result = "not_localized"
    else:
        result = "localized"
    return ReplayOutcome(result, report, "", elapsed, proc.returncode)
