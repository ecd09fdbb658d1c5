"""Finding a class named by a run: ``module`` + ``qualname``, or a training script by its path.

A class defined in the training script itself has ``__module__ == "__main__"``. The replay cannot
import ``__main__`` (that is the replay), and running the script would run the training. So the
script is loaded by path under another module name: its top level runs (imports, class and
function definitions), while the training behind ``if __name__ == "__main__":`` does not. Loading
it executes it, so it gets the checks a recipe gets (``replay/trust.py``): the script, its folder,
its ``__pycache__`` and the bytecode there must be ours and writable by no one else, and so must
each module it imports from its folder (:class:`sentineld.contracts.trust.ImportGuard`), unless
the replay was given ``--trust``.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["class_ref", "load_class"]


def class_ref(cls: type) -> dict[str, Any]:
    """Where ``cls`` lives, as JSON for ``run.json``.

    Returns:
        ``{"module": ..., "qualname": ..., "script": <absolute path or None>}``; ``script`` is set
        when the class lives in ``__main__`` (the training script), from ``__main__.__file__``.
    """
    script = None
    if cls.__module__ == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None) or inspect.getsourcefile(cls)
        script = str(Path(path).resolve()) if path else None
    return {"module": cls.__module__, "qualname": cls.__qualname__, "script": script}


def _script_module(script: Path, trust: bool) -> ModuleType:
    from sentineld.contracts.trust import check_owned, install_import_guard  # noqa: PLC0415

    if not script.is_file():
        raise FileNotFoundError(f"training script {script} (where the class was defined) is gone; "
                                "run the replay where the training code is, or pass --recipe")
    if not trust:
        cache = script.parent / "__pycache__"
        extra = [cache, *cache.glob(f"{script.stem}.*.pyc")] if cache.is_dir() else []
        for f in [script, script.parent, *extra]:
            check_owned(f)
        # What the script imports from its own folder is checked as it is imported, as for a
        # recipe's working folder (the script may live elsewhere than the run's working folder).
        install_import_guard(script.parent)
    name = "sentineld_script_" + re.sub(r"\W", "_", script.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(script):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {script} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look classes up here
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))  # the script's own sibling imports
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_class(ref: dict[str, Any], cwd: str, *, trust: bool) -> type:
    """Import the class ``ref`` names (see :func:`class_ref`).

    Args:
        ref: ``{"module", "qualname", "script"}``.
        cwd: the run's working directory (for a module next to the training script).
        trust: skip the ownership checks (the replay's ``--trust``).

    Raises:
        UntrustedError: the script or module is not safely ours.
        ValueError: the class is not at the top level of its module (defined inside a function or
            under ``if __name__ == "__main__":``), with what to change.
        ImportError, FileNotFoundError: the module or script cannot be loaded.
    """
    module, qualname, script = ref.get("module"), ref.get("qualname"), ref.get("script")
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ValueError(f"run.json names no class (got {ref!r})")
    if "<locals>" in qualname:
        raise ValueError(f"class {qualname} is defined inside a function; the replay can only "
                         "rebuild a class defined at the top level of a module or script")
    if module == "__main__":
        if not script:
            raise ValueError(f"class {qualname} was defined in __main__ without a script file "
                             "(a notebook or `python -c`); move it into a module and import it, "
                             "or pass a recipe")
        obj: Any = _script_module(Path(script), trust)
        where = f"script {script}"
    else:
        from sentineld.replay.trust import load_recipe_factory  # noqa: PLC0415

        # The same checks as a recipe: files of this module under the working directory.
        top = qualname.split(".")[0]
        load_recipe_factory(f"{module}:{top}", cwd, trust=trust, named_by=[])
        obj = importlib.import_module(module)
        where = f"module {module}"
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"class {qualname} is not defined at the top level of {where}; if it is "
                             "defined under `if __name__ == \"__main__\":`, move the class above "
                             "that line (keep only the training there)")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{qualname} in {where} is not a class")
    return obj
