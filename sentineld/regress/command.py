"""The ``sentineld regress`` command (registered in :mod:`sentineld.cli` with one line)."""

from __future__ import annotations

import click

__all__ = ["regress"]


@click.command()
@click.argument("run")
@click.option("--step", type=int, default=None, help="Step to guard (default: the capture's incident step).")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Folder for the test file and its fixture.")
@click.option("--rank", type=int, default=None, help="Use this rank's capture.")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None)
@click.option("--trust", is_flag=True,
              help="Write the test even if the run's files or code could have been written by another user.")
def regress(run: str, step: int | None, out_dir: str, rank: int | None, runs_dir: str | None, trust: bool) -> None:
    """Write a pytest regression test (and its HDF5 fixture) that RUN's offending step stays finite."""
    from sentineld.cliargs import fail as _fail  # noqa: PLC0415
    from sentineld.cliargs import run_dir_of as _run_dir  # noqa: PLC0415
    from sentineld.contracts.errors import SentineldError  # noqa: PLC0415

    from .write import write_regression  # noqa: PLC0415

    try:
        reg = write_regression(_run_dir(run, runs_dir), out_dir, step, rank, trust=trust)
    except (SentineldError, ValueError) as exc:  # bad run, capture or step; a run without recipe
        _fail(str(exc), getattr(exc, "exit_code", 2))
    except OSError as exc:
        _fail(f"cannot write the regression test: {exc}")
    if reg.warning:
        click.echo(f"warning: {reg.warning}", err=True)
    click.echo(f"{reg.test}\n{reg.fixture}\n{reg.sidecar}\n"
               f"steps {reg.snapshot_step}..{reg.step} from {reg.capture.name}; run it: pytest {reg.test} "
               "(keep the three files together; the project folder is \"code_root\" in the .json, relative "
               "to its folder, or $SENTINELD_REGRESS_ROOT)")
