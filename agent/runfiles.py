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

from sentineld.contracts.records import StartLine
from sentineld.contracts.rundir import RunDirError, RunMeta, make_private_dir, stream_path, write_run_meta
from sentineld.contracts.stream import StreamWriter

from .runinfo import torch_flags, unused_run_id

__all__ = ["RunFiles", "open_run_files"]

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
    ``start`` record; a run id this rank already used gets a ``.2``, ``.3``... suffix.

    ``extra`` goes into run.json's ``extra`` next to ``torch_flags`` (JSON values).

    Never raises for an unwritable directory: logs one error naming the fix and returns
    ``ok=False``.
    """
    ok = True
    try:
        run_id = unused_run_id(parent, run_id, rank)
        run_dir = make_private_dir(parent / run_id)
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
    stream.put(StartLine(run_id, rank, os.getpid(), socket.gethostname(), wall_clock()).to_json(), urgent=True)
    return RunFiles(run_id, run_dir, stream, ok)
