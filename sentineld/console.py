"""The rich Console the CLI and the demo print with: it never wraps a line.

rich wraps at the terminal's width, and at 80 columns when stdout is not a terminal (a pipe, a
CI log, ``make demo | tee``): a printed replay command broke across two lines and a panel title
was cut. Here text is soft-wrapped (a long line stays one line; a terminal folds it for display
only, and copying it gives the whole command back), and off a terminal the width is unbounded so
tables and titles keep their full length.
"""

from __future__ import annotations

from typing import Any

__all__ = ["console", "UNWRAPPED_WIDTH"]

#: Width given to a Console that does not print to a terminal: wide enough for any path or command.
UNWRAPPED_WIDTH = 10_000


def console(stderr: bool = False) -> Any:
    """A ``rich.console.Console`` on stdout (or stderr) that never wraps what it prints."""
    from rich.console import Console  # noqa: PLC0415

    con = Console(stderr=stderr, soft_wrap=True)
    if not con.is_terminal:
        con = Console(stderr=stderr, soft_wrap=True, width=UNWRAPPED_WIDTH)
    return con
