"""Write a run's report: gather, draw, assemble, write atomically (0600: it shows training data)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sentineld.contracts.safeio import write_atomic

__all__ = ["REPORT_NAME", "default_report_path", "write_report"]

#: The report's file name inside the run directory (where the daemon's verdict message points).
REPORT_NAME = "report.html"


def default_report_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where ``sentineld report <run>`` writes without ``-o``: ``<run_dir>/report.html``."""
    return Path(run_dir) / REPORT_NAME


def _replay_verdict(run_dir: Path, trust: bool) -> dict[str, Any]:
    from sentineld.contracts.trust import check_import_path  # noqa: PLC0415
    from sentineld.replay import replay_run  # noqa: PLC0415 - torch and the user's code

    if not trust:  # as `sentineld replay`: a module planted on the import path would run first
        check_import_path()
    return json.loads(replay_run(run_dir, trust=trust).to_json())


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                 state_dir: str | os.PathLike[str] | None = None,
                 verdict_path: str | os.PathLike[str] | None = None, replay: bool = False,
                 trust: bool = False, rank: int = 0, activations: bool = True) -> Path:
    """Write the HTML report of ``run_dir`` and return its path.

    Args:
        out: the file to write (default :func:`default_report_path`).
        state_dir: the daemon's state dir, for alerts and the daemon's replay verdict.
        verdict_path: a verdict JSON (``sentineld replay --json`` output or a daemon record).
        replay: run the replay now and show its verdict (imports the run's recipe).
        trust: import the recipe without the ownership checks.
        rank: whose stream and captures to show.
        activations: run one forward of the captured batch through the recipe.

    Raises:
        RunDirError: not a run directory. ValueError: a bad verdict file. OSError: unwritable
        ``out``. ReplayError, RecipeError, UntrustedError, CaptureError: from ``replay=True``.
    """
    from .page import render_html  # noqa: PLC0415 - matplotlib
    from .sources import gather, read_verdict  # noqa: PLC0415

    run_dir = Path(run_dir)
    verdict = None
    if verdict_path is not None:
        verdict = read_verdict(Path(verdict_path))
    elif replay:
        verdict = _replay_verdict(run_dir, trust)
    data = gather(run_dir, rank=rank, state_dir=Path(state_dir) if state_dir else None,
                  verdict=verdict, activations=activations, trust=trust)
    text = render_html(data)
    path = Path(out) if out is not None else default_report_path(run_dir)
    # The safe writer: a fresh O_EXCL temp file (a planted report.html.tmp link is never written
    # through), renamed in the run dir; a report.html someone else owns is refused, not replaced.
    write_atomic(path, text, durable=False)
    return path
