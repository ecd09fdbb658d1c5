"""The run's files as the agent opens them: the run directory (0700), ``run.json`` and this
rank's stream. A run directory that cannot be written switches the agent off, never the training.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from sentineld.contracts.rundir import (
    RunDir,
    RunDirError,
    RunMeta,
    make_private_dir,
    runs_dir_problem,
    stream_path,
    write_run_meta,
)
from sentineld.contracts.safeio import SafeDir, UnsafeDirError
from sentineld.contracts.stream import StreamWriter

from .runinfo import torch_flags

__all__ = ["RunFiles", "open_run_files", "claim_run_dir"]

#: Run ids tried (``<id>.2`` ... ``<id>.<N>``) before giving up on a name.
MAX_SUFFIX = 1000

log = logging.getLogger("sentineld.agent")


@dataclass
class RunFiles:
    """Where this rank writes. ``ok`` is False when the directory could not be written (then
    ``stream`` goes to /dev/null and the agent is off)."""

    run_id: str
    run_dir: Path
    stream: StreamWriter
    ok: bool


def open_run_files(parent: Path, run_id: str, rank: int, world: int, *, recipe: str | None,
                   recipe_args: dict[str, Any], num_classes: int | None, flush_s: float,
                   wall_clock: Callable[[], float], extra: dict[str, Any] | None = None) -> RunFiles:
    """Create ``parent/<run id>/`` with ``run.json`` and open this rank's stream, writing its
    ``start`` record; a run id this rank already used, or whose directory this user did not create
    (see :func:`claim_run_dir`), gets a ``.2``, ``.3``... suffix.

    ``extra`` goes into run.json's ``extra`` next to ``torch_flags`` (JSON values).

    Never raises for an unwritable directory: logs one error naming the fix and returns
    ``ok=False``.
    """
    ok = True
    try:
        make_private_dir(parent)
        run_id = claim_run_dir(parent, run_id, rank)
        run_dir = parent / run_id
        write_run_meta(run_dir, RunMeta(
            run_id=run_id, recipe=recipe, recipe_args=recipe_args, rank=rank,
            world_size=world, torch_version=str(torch.__version__), num_threads=torch.get_num_threads(),
            num_classes=num_classes, started_s=wall_clock(), extra={"torch_flags": torch_flags(), **(extra or {})}))
        stream = StreamWriter(stream_path(run_dir, rank), flush_s)
    except (OSError, RunDirError) as exc:
        # Monitoring must not stop the training it watches: run on, switched off.
        log.error("sentineld: cannot write run directory %s (%s); the agent is off, training "
                  "continues. Pass runs_dir= or set SENTINELD_RUNS_DIR to a writable directory",
                  parent / run_id, exc)
        ok = False
        run_dir = parent / run_id
        stream = StreamWriter(os.devnull, flush_s)
    stream.put({"kind": "start", "run_id": run_id, "rank": rank, "pid": os.getpid(),
                "host": socket.gethostname(), "time_s": wall_clock()}, urgent=True)
    return RunFiles(run_id, run_dir, stream, ok)


def claim_run_dir(parent: Path, run_id: str, rank: int) -> str:
    """The run id whose directory under ``parent`` this rank writes: ``run_id``, else ``run_id.2``,
    ``.3``... The directory is created 0700 by us, or is an existing one that is ours, writable
    by no one else, and holds no stream of this rank yet (another rank of the same run made it).

    Skipped, with one warning: a directory this rank already streamed into (re-running a script
    with a fixed run id must not append to the old stream), and one another user created or may
    write (run ids are predictable: in a shared runs dir she could pre-create ours with links to
    files of her choice inside; nothing in such a directory is ever opened).

    Raises:
        RunDirError: the runs dir cannot be trusted (:func:`runs_dir_problem`) or no free name.
    """
    problem = runs_dir_problem(parent)
    if problem:
        raise RunDirError(problem)
    reason = None
    for n in range(1, MAX_SUFFIX + 1):
        suffix = "" if n == 1 else f".{n}"
        candidate = run_id[: 128 - len(suffix)] + suffix  # run ids are at most 128 characters
        path = parent / candidate
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask; this one is ours
            break
        except FileExistsError:
            pass
        try:
            with SafeDir.open(path, owners=(os.geteuid(),), private=True) as d:
                try:
                    d.lstat(RunDir(path).stream(rank).name)
                except FileNotFoundError:
                    break  # ours, made by another rank of this run
            why = f"already has a stream for rank {rank}"
        except UnsafeDirError as exc:
            why = f"was not created by this user and is not used ({exc})"
        reason = reason or f"run dir {path} {why}"
    else:
        raise RunDirError(f"no free run id {run_id}.2 .. .{MAX_SUFFIX} under {parent}; pass another run_id=")
    if reason:
        log.warning("sentineld: %s; this run is %s", reason, candidate)
    return candidate
