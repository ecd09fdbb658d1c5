"""``sentineld preflight MODULE:FUNCTION --data MODULE:FUNCTION``: the click command and its table.

The recipe and data functions are imported from the current directory with the replay's
ownership checks (:func:`sentineld.replay.trust.load_recipe_factory`): importing runs the file.
torch and the checks are imported only once the arguments are known to be well formed.

Exit codes: 0 no check failed (warnings allowed), 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
from typing import Any, Callable

import click

from sentineld.contracts.errors import EXIT_BAD_INPUT, EXIT_OK

from .result import FAIL, PASS, SKIP, WARN, Check, overall_ok, to_json_dict

__all__ = ["preflight", "render"]

#: A check failed (0 and 2 are the CLI's, from sentineld.contracts.errors).
EXIT_FAILED = 1
#: Widest the "what was seen" and "fix" columns get (characters); longer text wraps at words.
TEXT_COLUMN_WIDTH = 72
_STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def _bad(message: str) -> None:
    click.echo(f"sentineld preflight: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _spec(value: str, what: str) -> str:
    mod, sep, fn = value.partition(":")
    if not sep or not mod or not fn or not fn.isidentifier():
        _bad(f"{what} must be MODULE:FUNCTION (e.g. train:make_recipe), got {value!r}")
    return value


def _call(spec: str, trust: bool, what: str) -> Any:
    """Import ``spec`` with the trust checks and call it; its prints go to stderr."""
    from sentineld.replay.trust import RecipeError, UntrustedError, load_recipe_factory  # noqa: PLC0415

    try:
        fn: Callable[[], Any] = load_recipe_factory(spec, os.getcwd(), trust=trust, named_by=[])
    except (RecipeError, UntrustedError) as exc:
        mod, _, name = spec.partition(":")
        # A missing function is not a wrong directory: say what to define.
        advice = (f"define {name}() in {mod}.py (README: \"Before a long run: sentineld preflight\")"
                  if f"has no attribute '{name}'" in str(exc) else
                  "run preflight in the directory holding the module")
        text = str(exc).replace("Run the replay where the training code is, or pass --recipe", advice)
        if what != "the recipe":  # the --data function: say "data function", not "recipe"
            text = re.sub(r"\brecipe\b", what.removeprefix("the "), text, count=1)
        _bad(text)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return fn()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code
        _bad(f"{what} {spec} raised {type(exc).__name__}: {exc}")


def render(checks: list[Check]) -> None:
    """Print the checks as a rich table, then the per-module output shapes."""
    from rich.table import Table  # noqa: PLC0415

    from sentineld.console import console as make_console  # noqa: PLC0415

    console = make_console()  # piped output is not cut at 80 columns
    table = Table(title="sentineld preflight", show_lines=True)
    for col in ("#", "check", "status", "what was seen", "fix"):
        # The text columns wrap at words: off a terminal the console is unbounded (no cut
        # commands), which made a ~700-column table of one-line cells.
        table.add_column(col, overflow="fold", max_width=TEXT_COLUMN_WIDTH if col in ("what was seen", "fix") else None)
    for i, c in enumerate(checks, 1):
        table.add_row(str(i), c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.message, c.fix)
    console.print(table)
    shapes = next((c for c in checks if c.name == "shapes"), None)
    if shapes and shapes.evidence.get("table"):
        st = Table(title="output shape of each module (call order)")
        for col in ("module", "type", "output shape"):
            st.add_column(col)
        for row in shapes.evidence["table"]:
            st.add_row(*row)
        console.print(st)
    n = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP)}
    verdict = "[green]ok[/]" if overall_ok(checks) else "[bold red]failed[/]"
    skipped = f", {n[SKIP]} not run (blocked by a failed check)" if n[SKIP] else ""
    console.print(f"preflight {verdict}: {n[PASS]} pass, {n[WARN]} warn, {n[FAIL]} fail{skipped}")


@click.command("preflight")
@click.argument("recipe")
@click.option("--data", "data", required=True, help="MODULE:FUNCTION returning an iterable of training batches.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks and an overall 'ok' as JSON.")
@click.option("--lr-range", is_flag=True, help="Also run a learning-rate range test and plot it.")
@click.option("--lr-plot", type=click.Path(dir_okay=False), default=None,
              help="Where the LR plot goes (.png or .svg; default ./preflight-lr-range.png).")
@click.option("--num-classes", type=click.IntRange(min=2), default=None,
              help="C of a C-class cross-entropy (default: the recipe's, else read off the loss).")
@click.option("--steps", "overfit_steps", type=click.IntRange(min=1), default=300, show_default=True,
              help="Step budget of the overfit-one-batch check.")
@click.option("--trust", is_flag=True, help="Import the modules even if another user could have written them.")
def preflight(recipe: str, data: str, as_json: bool, lr_range: bool, lr_plot: str | None,
              num_classes: int | None, overfit_steps: int, trust: bool) -> None:
    """Check a training setup before a long run: RECIPE is MODULE:FUNCTION returning a Recipe,
    a LightningModule or a transformers model.

    Runs the method's checklist (labels, inputs, output layer vs loss, first loss vs ln C,
    gradient flow and application, shapes, gradcheck, dead units) and Rule #1 (overfit one
    batch) on copies of the recipe's model and optimizer.
    """
    _spec(recipe, "RECIPE")
    _spec(data, "--data")
    if lr_plot is not None and not lr_plot.lower().endswith((".png", ".svg")):
        _bad(f"--lr-plot must end in .png or .svg, got {lr_plot!r}")
    if lr_range and importlib.util.find_spec("matplotlib") is None:
        _bad("--lr-range plots with matplotlib, which is not installed: pip install 'sentineld[preflight]'")
    built = _call(recipe, trust, "the recipe")
    from sentineld.contracts.recipe import Recipe  # noqa: PLC0415 - imports torch

    from .frameworks import framework_of  # noqa: PLC0415

    if not isinstance(built, Recipe) and framework_of(built) is None:
        _bad(f"{recipe} returned {type(built).__name__}, not a sentineld.recipe.Recipe "
             "(Recipe(model=..., optimizer=..., loss_fn=...)), a LightningModule or a transformers model")
    batches = _call(data, trust, "the data function")
    from .runner import check, check_recipe  # noqa: PLC0415

    opts: dict[str, Any] = {"lr_range": lr_range, "lr_plot": lr_plot, "overfit_steps": overfit_steps}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if isinstance(built, Recipe):
                checks = check_recipe(built, batches, num_classes=num_classes or built.num_classes, **opts)
            else:
                checks = check(built, None, None, batches, num_classes=num_classes, **opts)
    except (TypeError, ValueError) as exc:
        _bad(f"{exc} (recipe {recipe}, data {data})")
    except SystemExit as exc:  # the user's loss_fn / step called sys.exit: not preflight's exit code
        _bad(f"the recipe's code called sys.exit({exc.code!r}) during the checks (recipe {recipe}, data {data})")
    if as_json:
        click.echo(json.dumps(to_json_dict(checks), indent=2))
    else:
        render(checks)
    sys.exit(EXIT_OK if overall_ok(checks) else EXIT_FAILED)
