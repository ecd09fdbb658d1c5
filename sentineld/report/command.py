"""The ``sentineld report`` command (registered in :mod:`sentineld.cli` with one line)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

__all__ = ["report"]


@click.command()
@click.argument("run")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="HTML file to write (default RUN_DIR/report.html).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Daemon state dir holding alerts and verdicts (default: the configured one).")
@click.option("--verdict", "verdict_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Show this replay verdict (JSON of `sentineld replay --json` or a daemon record).")
@click.option("--replay", "do_replay", is_flag=True, help="Run the replay now and show its verdict.")
@click.option("--no-activations", is_flag=True, help="Do not run the captured batch through the recipe.")
@click.option("--trust", is_flag=True, help="Import the recipe even if another user could have written it.")
@click.option("--rank", type=int, default=0, show_default=True, help="Rank whose stream and captures to show.")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None)
def report(run: str, output: str | None, state_dir: str | None, verdict_path: str | None, do_replay: bool,
           no_activations: bool, trust: bool, rank: int, runs_dir: str | None) -> None:
    """Write one self-contained HTML report of RUN (an id or a directory)."""
    logging.basicConfig(level=logging.WARNING, format="sentineld: %(message)s", stream=sys.stderr)
    from sentineld.cliargs import fail as _fail  # noqa: PLC0415
    from sentineld.cliargs import run_dir_of as _run_dir  # noqa: PLC0415
    from sentineld.cliargs import safe_state_dir as _safe_state_dir  # noqa: PLC0415
    from sentineld.contracts.errors import SentineldError  # noqa: PLC0415
    from sentineld.replay.main import stdout_to_stderr  # noqa: PLC0415

    from .build import write_report  # noqa: PLC0415

    if verdict_path and do_replay:
        _fail("pass --verdict or --replay, not both")
    try:
        run_dir = _run_dir(run, runs_dir)
        sd = Path(state_dir) if state_dir else _safe_state_dir()
        with stdout_to_stderr():  # the user's code may print: stdout carries only the path
            path = write_report(run_dir, output, state_dir=sd, verdict_path=verdict_path, replay=do_replay,
                                trust=trust, rank=rank, activations=not no_activations)
    except (SentineldError, ValueError) as exc:  # bad run, capture, verdict file, recipe, trust
        _fail(str(exc), getattr(exc, "exit_code", 2))
    except ImportError as exc:
        if getattr(exc, "name", None) != "matplotlib":
            raise
        _fail("sentineld report draws with matplotlib, which is not installed: "
              "pip install 'sentineld[report]'")
    except OSError as exc:
        _fail(f"cannot write the report: {exc}")
    click.echo(str(path))
