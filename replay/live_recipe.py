"""The built-in recipe of a run attached with ``loss_fn=`` (no recipe): rebuilt from run.json.

At attach the agent records the structure of the live model, optimizer and scheduler and where the
loss function is defined (:mod:`sentineld.contracts.structure`) as this recipe's JSON arguments
(``run.json``: ``extra.live_recipe``). ``sentineld replay``, ``report`` and the tests ``regress``
writes then rebuild the run through :func:`recipe_from_run`, which imports the classes and the
loss function from their modules, or from the training script by path (its top level runs, what
is under ``if __name__ == "__main__":`` does not), after the replay's ownership checks
(:mod:`replay.trust`; ``--trust`` overrides). A lambda is compiled from its line in the file that
defines it, in that module's namespace.

Refused, with what to do: a closure (a lambda using variables of the function it was made in), a
training script that trains at its top level (loading it would train), an attribute that is not
plain data.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any, Callable

import torch

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rundir import RunMeta
from sentineld.contracts.structure import (
    StructureError,
    build_module,
    build_optimizer,
    build_scheduler,
    decode_value,
    unguarded_statements,
)

__all__ = ["LIVE_RECIPE", "recipe_of", "recipe_from_run", "Loader", "unguarded_statements"]

#: The ``module:function`` of this recipe, as run.json and the regression tests name it.
LIVE_RECIPE = "sentineld.replay.live_recipe:recipe_from_run"


def recipe_of(meta: RunMeta) -> tuple[str, dict[str, Any]] | None:
    """``(recipe, recipe_args)`` that rebuild the run: its own recipe, else the recorded live
    objects of a ``loss_fn`` run, else None (a forward-only run or an old one)."""
    if meta.recipe:
        return meta.recipe, dict(meta.recipe_args)
    live = meta.extra.get("live_recipe") if isinstance(meta.extra, dict) else None
    if isinstance(live, dict) and isinstance(live.get("loss_fn"), dict):
        return LIVE_RECIPE, {**live, "root": live.get("root") or meta.cwd}
    return None


class Loader:
    """Imports the classes and functions a structure names, once each, with the trust checks.

    Args:
        root: the run's working directory (modules are imported from there first; a relative
            script path is relative to it).
        trust: skip the ownership checks (``--trust``).
    """

    def __init__(self, root: str, trust: bool) -> None:
        self.root, self.trust = root, trust
        self._modules: dict[str, Any] = {}
        self._objs: dict[str, Any] = {}

    def _script(self, script: str) -> Any:
        from sentineld.integrations.codeload import _script_module  # noqa: PLC0415 - the one script loader

        path = Path(script) if Path(script).is_absolute() else Path(self.root) / script
        if not path.is_file():
            raise StructureError(f"the training script {path} (where the run's classes and loss_fn are "
                                 "defined) is gone; run from the project's folder, or pass --recipe")
        lines = unguarded_statements(path.read_text(encoding="utf-8", errors="replace"))
        if lines:
            raise StructureError(f"the training script {path.name} trains at its top level (line(s) "
                                 f"{', '.join(map(str, lines[:5]))}), so loading its classes and loss_fn "
                                 "would train: put the training under `if __name__ == \"__main__\":` or "
                                 "move the model and loss_fn into a module")
        return _script_module(path, self.trust)

    def module(self, ref: dict[str, Any]) -> Any:
        """The module of ``ref`` (``{"module", "qualname", "script"}``)."""
        name, script = str(ref.get("module") or ""), ref.get("script")
        key = f"{name}|{script}"
        if key not in self._modules:
            if name == "__main__":
                if not script:
                    raise StructureError(f"{ref.get('qualname')} was defined in __main__ without a script "
                                         "file (a notebook or `python -c`); move it into a module")
                self._modules[key] = self._script(str(script))
            else:
                from sentineld.replay.trust import load_recipe_factory  # noqa: PLC0415

                top = str(ref.get("qualname") or "").split(".")[0]
                if top and "<" not in top and not self.trust:  # the ownership checks of the module's files
                    load_recipe_factory(f"{name}:{top}", self.root, trust=self.trust, named_by=[])
                self._modules[key] = importlib.import_module(name)
        return self._modules[key]

    def __call__(self, ref: dict[str, Any]) -> Any:
        """The class or top-level function ``ref`` names."""
        key = f"{ref.get('module')}|{ref.get('qualname')}|{ref.get('script')}"
        if key not in self._objs:
            obj = self.module(ref)
            for part in str(ref.get("qualname") or "").split("."):
                if not hasattr(obj, part):
                    raise StructureError(f"{ref.get('qualname')} is not defined at the top level of "
                                         f"{ref.get('script') or ref.get('module')}; if it is under "
                                         "`if __name__ == \"__main__\":`, move it above that line")
                obj = getattr(obj, part)
            self._objs[key] = obj
        return self._objs[key]

    def function(self, ref: dict[str, Any]) -> Callable[..., Any]:
        """The function ``ref`` names (:func:`sentineld.contracts.structure.function_ref`)."""
        if "unrecordable" in ref:
            raise StructureError(str(ref["unrecordable"]) + "; pass a function or lambda as loss_fn, or a recipe")
        if "line" not in ref:
            return self(ref)
        if ref.get("freevars"):
            raise StructureError(f"loss_fn uses {', '.join(ref['freevars'])} from the function it was made in "
                                 "(a closure), which the run did not record: define it at the top level of "
                                 "the training script or a module")
        module = self.module(ref)
        file = Path(str(ref.get("file") or getattr(module, "__file__", "")))
        if not file.is_absolute():
            file = Path(self.root) / file
        tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"), str(file))
        line, args, name = int(ref["line"]), list(ref.get("args") or []), ref.get("name")
        for node in ast.walk(tree):
            if name == "<lambda>" and isinstance(node, ast.Lambda) and node.lineno == line \
                    and [a.arg for a in node.args.args] == args:
                code = compile(ast.fix_missing_locations(ast.Expression(body=node)), str(file), "eval")
                return eval(code, module.__dict__)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and \
                    line in (node.lineno, *(d.lineno for d in node.decorator_list)):
                mod = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
                local: dict[str, Any] = {}
                exec(compile(mod, str(file), "exec"), module.__dict__, local)
                return local[str(name)]
        raise StructureError(f"loss_fn ({name} at {file.name}:{line}) is no longer in {file}; the file changed "
                             "since the run, so it cannot be rebuilt")


def recipe_from_run(*, model: dict[str, Any], optimizer: dict[str, Any], loss_fn: dict[str, Any],
                    root: str, scheduler: dict[str, Any] | None = None, scaler: dict[str, Any] | None = None,
                    clip_grad_norm: float | None = None, accumulation_steps: int = 1,
                    autocast_dtype: str | None = None, num_classes: int | None = None,
                    device: str | None = None) -> Recipe:
    """The :class:`Recipe` of a ``loss_fn`` run, rebuilt from its recorded live objects.

    Args:
        model, optimizer, scheduler: structures (:mod:`sentineld.contracts.structure`).
        loss_fn: where the loss function is defined (``function_ref``).
        root: the project folder (the run's working directory; a regression test passes its own).
        scaler: ``{"enabled", "device"}`` of the run's GradScaler, or None.
        autocast_dtype: ``"float16"`` / ``"bfloat16"`` when the training forward ran under autocast.

    Raises:
        StructureError: something recorded cannot be rebuilt (the message says what to do).
        UntrustedError: a module or script is not safely ours.
    """
    from sentineld.replay.trust import trust_given  # noqa: PLC0415

    load = Loader(root, trust_given())
    net = build_module(model, load, device)
    opt = build_optimizer(optimizer, net, load)
    sched = build_scheduler(scheduler, opt, load, load.function) if scheduler else None
    grad_scaler = None
    if scaler:
        grad_scaler = torch.amp.GradScaler(str(scaler.get("device") or "cuda"),
                                           enabled=bool(scaler.get("enabled", True)))
    dt = decode_value({"__dtype__": autocast_dtype}, load) if autocast_dtype else None
    return Recipe(model=net, optimizer=opt, loss_fn=load.function(loss_fn), scheduler=sched, scaler=grad_scaler,
                  clip_grad_norm=clip_grad_norm, accumulation_steps=int(accumulation_steps),
                  autocast_dtype=dt, num_classes=num_classes)
