"""What every ``sentineld`` command shares: the command group that maps errors to exit codes, and
how a RUN argument and the state dir are found. Its own module so that the commands defined
elsewhere (``report``, ``regress``, ``preflight``) need not import the CLI that lists them.

Exit codes (README, ``sentineld --help``; :mod:`sentineld.contracts.errors`) are mapped in one
place, :class:`SentineldGroup` (click's ``Command.main`` does the same for ``ClickException``):
a command raises a :class:`~sentineld.contracts.errors.SentineldError` (or calls :func:`fail`),
and its message goes to stderr as ``sentineld: <message>`` with the error's exit code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import click

from sentineld.contracts.errors import EXIT_BAD_INPUT, SentineldError

__all__ = ["SentineldGroup", "fail", "run_dir_of", "safe_state_dir"]


class SentineldGroup(click.Group):
    """A click group whose commands' :class:`SentineldError` exits with the error's code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SentineldError as exc:
            click.echo(f"sentineld: {exc}", err=True)
            ctx.exit(exc.exit_code)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """End the command: ``sentineld: <message>`` on stderr, exit status ``code``.

    Raises:
        SentineldError: always (the group prints it and exits with ``code``).
    """
    err = SentineldError(message)
    err.exit_code = code
    raise err


def run_dir_of(run: str, runs_dir: str | None) -> Path:
    """RUN as a directory: a path, or an id under ``runs_dir`` / the configured runs dir.

    Raises:
        RunDirError: neither exists.
    """
    from sentineld.contracts.rundir import resolve_run  # noqa: PLC0415
    from sentineld.daemon.daemon_config import ConfigError, load_config  # noqa: PLC0415

    if runs_dir is None:
        try:
            runs_dir = str(load_config().runs_dir)
        except ConfigError:
            runs_dir = None
    return resolve_run(run, runs_dir)


def safe_state_dir() -> Path:
    """The configured state dir, or the default one when the config cannot be read."""
    from sentineld.daemon.daemon_config import ConfigError, default_state_dir, load_config  # noqa: PLC0415

    try:
        return load_config().state_dir
    except ConfigError:
        return default_state_dir()
