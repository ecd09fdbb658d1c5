"""The replay's command line: ``python -m sentineld.replay RUN [--step N] [--json] ...`` (the
daemon spawns this with the run's own interpreter and working directory) and the body of
``sentineld replay``. Imports no CLI or daemon code, and no torch until the capture opened: a
damaged capture is reported in a fraction of a second.

Exit codes (:mod:`sentineld.contracts.errors`), from the verdict's outcome
(:func:`sentineld.contracts.verdict.verdict_exit_code`, the daemon's ``result``): 0 localized or
not_localized (the step reproduced; for a loss spike, a cause named), 1 not_reproduced, 2 bad
input (any :class:`~sentineld.contracts.errors.BadInput`: unknown run, damaged capture, missing
step, untrusted or unbuildable recipe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, Callable, Iterator

import click

from sentineld.contracts.errors import BadInput, SentineldError
from sentineld.contracts.rundir import default_runs_dir, resolve_run
from sentineld.contracts.trust import add_replay_path, check_import_path

__all__ = ["replay_options", "run_replay", "stdout_to_stderr", "command", "main"]


def replay_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The replay's click argument and options (shared by ``sentineld replay``)."""
    opts = [
        click.argument("run"),
        click.option("--step", type=int, default=None,
                     help="Step to explain (default: the first non-finite one)."),
        click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON on stdout."),
        click.option("--recipe", default=None,
                     help="module:function building the Recipe (overrides run.json)."),
        click.option("--capture", type=click.Path(dir_okay=False), default=None,
                     help="Use this capture file."),
        click.option("--trust", is_flag=True,
                     help="Import the recipe even if another user could have written it."),
        click.option("--rank", type=int, default=None,
                     help="Replay this rank's capture (default: the rank whose own loss went "
                          "non-finite first)."),
        click.option("--what-if", "what_if", is_flag=True,
                     help="Also re-run the step under candidate fixes (eps at the culprit op, lr x0.1, "
                          "clipping, ...) and classify the fault (software, precision, compiler, "
                          "transient). A candidate finite for the checked steps is evidence, not proof."),
        click.option("--repeats", type=click.IntRange(2, 50), default=3, show_default=True,
                     help="Runs of the unchanged step for the reproducibility class (with --what-if)."),
        click.option("--world-size", "world_size", type=int, default=None,
                     help="Re-launch an FSDP2 run's replay on N ranks through torchrun, each rank loading "
                          "its shard of the DCP checkpoint (N: the run's world size). Default: the "
                          "consolidated replay in one process, when the state fits this host's memory."),
        click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
                     help="Parent of run directories, where a RUN id is looked up (default: "
                          "$SENTINELD_RUNS_DIR, the config's runs_dir, else "
                          "~/.local/state/sentineld/runs). Not needed when RUN is a directory."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def run_replay(run: str, step: int | None, as_json: bool, recipe: str | None, capture: str | None,
               trust: bool, runs_dir: str | None, rank: int | None = None, what_if: bool = False,
               repeats: int = 3, world_size: int | None = None) -> int:
    """Replay RUN (an id under ``runs_dir`` or a directory), print the verdict, return the exit code.

    Args:
        runs_dir: parent of run directories for a run id; None: ``$SENTINELD_RUNS_DIR`` or the
            user state dir (:func:`sentineld.contracts.rundir.default_runs_dir`).
        world_size: re-launch an FSDP2 run's replay on this many ranks (torchrun,
            :mod:`sentineld.replay.fsdp_relaunch`); None: the replay in this process.

    Returns:
        The verdict's :func:`~sentineld.contracts.verdict.verdict_exit_code` (0 localized or
        not_localized, 1 not_reproduced); a bad input prints ``sentineld: <why>`` to stderr and
        returns its error's exit code (2).
    """
    logging.basicConfig(level=logging.WARNING, format="sentineld: %(message)s", stream=sys.stderr)
    try:
        add_replay_path()  # the daemon's $PYTHONPATH, which `python -I` left out
        if not trust:  # a module another user could add to this path would run before any recipe check
            check_import_path()
        run_dir = resolve_run(run, runs_dir if runs_dir is not None else default_runs_dir())
        if capture is not None:
            from sentineld.contracts.capture import open_capture  # noqa: PLC0415

            with open_capture(capture):  # a damaged capture fails here, before torch is imported
                pass
        from sentineld.contracts.verdict import render_text, verdict_exit_code  # noqa: PLC0415

        if world_size is not None:
            if rank is not None or what_if:
                raise BadInput("--world-size replays every rank together: drop --rank and --what-if "
                               "(or drop --world-size for the replay in one process)")
            from sentineld.replay.fsdp_relaunch import relaunch  # noqa: PLC0415

            verdict = relaunch(run_dir, world_size, step, recipe=recipe, trust=trust, capture=capture)
            click.echo(json.dumps(verdict, indent=2, sort_keys=True) if as_json else render_text(verdict))
            return verdict_exit_code(verdict)
        from sentineld.replay.engine import replay_run  # noqa: PLC0415

        with stdout_to_stderr():  # the user's code may print: stdout carries only the verdict
            report = replay_run(run_dir, step, recipe=recipe, trust=trust, capture=capture, rank=rank,
                                what_if=what_if, repeats=repeats)
    except SentineldError as exc:
        click.echo(f"sentineld: {exc}", err=True)
        return exc.exit_code
    click.echo(report.to_json() if as_json else render_text(report))
    return verdict_exit_code(report)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (Python and file descriptor 1) to stderr meanwhile."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    saved = sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved


@click.command(name="replay")
@replay_options
def command(run: str, step: int | None, as_json: bool, recipe: str | None, capture: str | None,
            trust: bool, rank: int | None, runs_dir: str | None, what_if: bool = False, repeats: int = 3,
            world_size: int | None = None) -> None:
    """Rebuild RUN (an id or a directory) before the offending step and name where it broke.

    Exit codes, from the verdict's outcome: 0 localized or not_localized (the step reproduced; a
    loss spike's cause named), 1 not_reproduced, 2 bad input (unknown run, damaged capture, missing
    step, untrusted or unbuildable recipe)."""
    sys.exit(run_replay(run, step, as_json, recipe, capture, trust, runs_dir, rank, what_if, repeats, world_size))


def main() -> None:
    """Entry point of ``python -m sentineld.replay``."""
    command.main(prog_name="python -m sentineld.replay")
