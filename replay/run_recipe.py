"""The run's recipe as the replay builds it: the one place the user's recipe function is found,
checked and called (the engine, the compiled re-run child and the FSDP relaunch ranks use it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rundir import RunMeta

from .errors import ReplayError
from .trust import UntrustedError, load_recipe_factory

__all__ = ["recipe_factory"]


def recipe_factory(meta: RunMeta, recipe_spec: str | None, trust: bool, named_by: list[Path]) -> Callable[[], Recipe]:
    """Import the recipe function (after the ownership checks) bound to the run's arguments: the
    ``--recipe`` given, run.json's recipe, or the live objects a ``loss_fn`` run recorded
    (:mod:`replay.live_recipe`).

    Args:
        meta: the run's run.json.
        recipe_spec: ``module:function`` given by the user, or None for the run's own.
        trust: skip the ownership checks of the modules imported (``--trust``).
        named_by: the files that named the recipe (their owners must be trusted too).

    Returns:
        A function building a fresh :class:`Recipe` each call.

    Raises:
        ReplayError: no recipe recorded or given, the recipe raised or returned something else.
        UntrustedError, RecipeError: from :func:`replay.trust.load_recipe_factory`.
    """
    from .live_recipe import recipe_of  # noqa: PLC0415

    found = (recipe_spec, dict(meta.recipe_args)) if recipe_spec else recipe_of(meta)
    if found is None:
        raise ReplayError(f"run {meta.run_id} recorded no recipe; pass --recipe module:function "
                          "(a function returning sentineld.recipe.Recipe)")
    spec, args = found
    fn = load_recipe_factory(spec, meta.cwd, trust=trust, named_by=named_by)
    return lambda: _build(fn, spec, args)


def _build(factory: Callable[..., Any], spec: str, args: dict[str, Any]) -> Recipe:
    try:
        recipe = factory(**args)
    except UntrustedError:
        raise  # a module the recipe imports is not safely ours: say so, not "the recipe raised"
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code, sys.exit() included
        if spec.startswith("sentineld.replay.live_recipe:"):
            raise ReplayError(f"the run's recorded model, optimizer and loss_fn (attach(loss_fn=)) cannot be "
                              f"rebuilt: {exc}") from None
        raise ReplayError(f"recipe {spec} raised while building the model: "
                          f"{type(exc).__name__}: {exc}") from None
    if not isinstance(recipe, Recipe):
        raise ReplayError(f"recipe {spec} returned {type(recipe).__name__}, not sentineld.recipe.Recipe")
    return recipe
