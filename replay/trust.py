"""Deciding whether code named by a run may be imported, and importing it.

A capture never holds code. The run's ``run.json`` names a recipe (``module:function``) in the
run's working directory, and the replay imports it: that executes the file. It is imported only
when ``run.json``, the capture, every file of the recipe module under the working directory (the
package ``__init__.py`` files along its path and the module itself) and the folders holding them
are owned by the current user (or root) and writable by no one else; ``trust=True`` overrides with a
warning (for a colleague's run you have read). Every module imported later from the working
directory (what the recipe pulls in, at once or lazily) passes the same check when it is imported
(:class:`sentineld.contracts.trust.ImportGuard`).
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.errors import BadInput
from sentineld.contracts.trust import UntrustedError, check_owned, install_import_guard

__all__ = ["UntrustedError", "RecipeError", "check_owned", "load_recipe_factory", "recipe_files", "trust_given"]

log = logging.getLogger("sentineld.replay")


# Set by load_recipe_factory: a built-in recipe that imports more code named by the run (the
# Lightning/HF integrations load the user's module class) applies the same --trust decision.
_TRUST: contextvars.ContextVar[bool] = contextvars.ContextVar("sentineld_trust", default=False)


def trust_given() -> bool:
    """True when the recipe being built was imported with ``trust=True`` (``--trust``)."""
    return _TRUST.get()


class RecipeError(BadInput):
    """The recipe cannot be imported or does not build a Recipe."""


def _module_files(cwd: Path, module: str) -> list[Path]:
    parts = module.split(".")
    files = []
    for i in range(1, len(parts) + 1):
        base = cwd.joinpath(*parts[:i])
        init = base / "__init__.py"
        if init.is_file():
            files.append(init)
        elif i == len(parts) and base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
    return files


def recipe_files(module: str, cwd: Path) -> list[Path]:
    """The files whose ownership is checked before ``module`` is imported from ``cwd``: its files
    under ``cwd`` (package ``__init__.py`` files along the path and the module), the folders holding
    them (whoever can write there can swap the files) and their ``__pycache__`` with the bytecode
    (a .pyc compiled with an unchecked hash runs without its source being looked at)."""
    mod_files = _module_files(cwd, module)
    dirs = list(dict.fromkeys(f.parent for f in mod_files))
    caches = [d / "__pycache__" for d in dirs if (d / "__pycache__").is_dir()]
    cached = [c for d in caches for c in d.glob("*.pyc")]
    return mod_files + dirs + caches + cached


def load_recipe_factory(recipe: str, cwd: str, *, trust: bool, named_by: list[Path]) -> Callable[[], Any]:
    """Import ``module:function`` from ``cwd`` after the ownership checks; return the function.

    Args:
        recipe: ``"module:function"``.
        cwd: the run's working directory (put first on ``sys.path``).
        trust: skip the checks (logged as a warning).
        named_by: files that name this code (run.json, the capture): checked too.

    Raises:
        UntrustedError: a checked file is not safely ours.
        RecipeError: the module or function cannot be imported.
    """
    mod_name, colon, fn_name = recipe.partition(":")
    if not colon or not mod_name or not fn_name:
        raise RecipeError(f"recipe {recipe!r} must be 'module:function' (for a function make_recipe in "
                          f"train.py: 'train:make_recipe'; here, say '{mod_name or recipe}:make_recipe')")
    cwd_path = Path(cwd)
    files = recipe_files(mod_name, cwd_path) + list(named_by)
    _TRUST.set(trust)
    if trust:
        log.warning("sentineld: --trust given: importing %s without ownership checks", recipe)
    else:
        for f in files:
            check_owned(f)
        # What the recipe imports from its folder is checked as it is imported, including modules
        # planted there that would shadow an installed one (a world-writable working folder).
        install_import_guard(cwd_path)
    if str(cwd_path) not in sys.path:
        sys.path.insert(0, str(cwd_path))
    try:
        module = importlib.import_module(mod_name)
        fn = getattr(module, fn_name)
    except UntrustedError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code can raise anything on import
        raise RecipeError(f"cannot import recipe {recipe!r} from {cwd}: {type(exc).__name__}: {exc}. "
                          "Run the replay where the training code is, or pass --recipe") from None
    if not callable(fn):
        raise RecipeError(f"recipe {recipe!r} is not callable")
    return fn
