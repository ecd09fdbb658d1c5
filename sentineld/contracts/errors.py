"""The errors every part raises for its caller to report, and the exit codes they map to.

Torch-free and dependency-free, so the CLI and ``python -m sentineld.replay`` can catch a replay
error by its class (``except SentineldError``) before anything heavy is imported.

Exit codes (README, ``sentineld --help``):
    0  success; for a replay, a verdict whose outcome is localized or not_localized (the step
       reproduced; a loss spike's cause named): ``verdict.verdict_exit_code``
    1  a replay whose verdict's outcome is not_reproduced; ``demo``: no verdict arrived in time
    2  bad input: unknown run, missing or corrupt capture, missing step, bad config, untrusted
       or unbuildable recipe
    3  ``status``/``stop``: no daemon is running
"""

from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_NOT_REPRODUCED", "EXIT_BAD_INPUT", "EXIT_NOT_RUNNING", "SentineldError",
           "BadInput", "NoDaemon"]

EXIT_OK, EXIT_NOT_REPRODUCED, EXIT_BAD_INPUT, EXIT_NOT_RUNNING = 0, 1, 2, 3


class SentineldError(Exception):
    """Base of the errors whose message is meant for the user; ``exit_code`` is the CLI's."""

    exit_code: int = EXIT_BAD_INPUT


class BadInput(SentineldError):
    """What the user gave (run, capture, step, config, recipe) is wrong; the message says what
    and what to do. Exit code 2."""

    exit_code = EXIT_BAD_INPUT


class NoDaemon(SentineldError):
    """No daemon is running where one was asked for. Exit code 3."""

    exit_code = EXIT_NOT_RUNNING
