"""What a test written by ``sentineld regress`` runs: rebuild through the recipe from the fixture and
assert each step stays finite.

The generated file imports only :func:`sentineld.regress.assert_steps_finite`, so the replay's
internals (where the state loader and the step runner live) can move without breaking tests that
users keep in their repositories.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from sentineld.contracts.capture import open_capture
from sentineld.contracts.recipe import Recipe

__all__ = ["HYPERPARAMETER_SOURCES", "ROOT_ENV", "assert_steps_finite", "read_sidecar"]

#: Environment variable naming the project folder (overrides the sidecar's ``code_root``).
ROOT_ENV = "SENTINELD_REGRESS_ROOT"
#: Largest sidecar read (a live recipe's structure of a large model is a few MiB at most).
MAX_SIDECAR_BYTES = 16 << 20

#: Where the optimizer settings (lr, eps, betas, ...) come from: the captured state, or the recipe.
HYPERPARAMETER_SOURCES = ("capture", "recipe")


def read_sidecar(sidecar: str | os.PathLike[str]) -> dict[str, Any]:
    """The sidecar JSON of a regression test, with ``fixture`` and ``cwd`` (the project folder:
    ``$SENTINELD_REGRESS_ROOT``, else ``code_root`` relative to the sidecar's folder) resolved.

    Raises:
        FileNotFoundError: the sidecar, its fixture or the project folder is missing (the message
            says what to set).
        ValueError: it is not a sidecar ``sentineld regress`` wrote.
    """
    path = Path(sidecar)
    with open(path, "rb") as f:
        raw = f.read(MAX_SIDECAR_BYTES + 1)
    if len(raw) > MAX_SIDECAR_BYTES:
        raise ValueError(f"{path} is over {MAX_SIDECAR_BYTES} bytes: not a sentineld regress sidecar")
    data = json.loads(raw)
    if not (isinstance(data, dict) and isinstance(data.get("recipe"), str) and isinstance(data.get("fixture"), str)):
        raise ValueError(f"{path} is not a sentineld regress sidecar (no recipe/fixture)")
    fixture = path.parent / Path(data["fixture"]).name
    if not fixture.is_file():
        raise FileNotFoundError(f"the fixture {fixture.name} is not next to {path.name}; keep the .py, .json "
                                "and .h5 files together")
    env = os.environ.get(ROOT_ENV)
    root = Path(env) if env else (path.parent / str(data.get("code_root") or ".")).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"the project folder {root} (\"code_root\" in {path.name}, relative to its "
                                f"folder) does not exist: edit code_root or set {ROOT_ENV} to the project folder")
    return {**data, "fixture": str(fixture), "cwd": str(root)}


def _recipe(recipe: str, recipe_args: dict[str, Any], cwd: str) -> Recipe:
    for path in (cwd, os.getcwd()):  # the working directory comes first
        if path not in sys.path:
            sys.path.insert(0, path)
    module, _, function = recipe.partition(":")
    fn = getattr(importlib.import_module(module), function)
    with_root = "root" in inspect.signature(fn).parameters  # the live recipe: scripts relative to the project
    if with_root:
        from sentineld.replay.trust import _TRUST  # noqa: PLC0415

        # The user's own test of their own project, as a recipe module is imported here; the
        # ownership checks ran when `sentineld regress` wrote it.
        _TRUST.set(True)
    rec = fn(**({**recipe_args, "root": cwd} if with_root else recipe_args))
    if not isinstance(rec, Recipe):
        raise TypeError(f"recipe {recipe} returned {type(rec).__name__}, not sentineld.recipe.Recipe")
    return rec


def _nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> list[str]:
    return [name for name, t in named if t is not None and not bool(torch.isfinite(t).all())]


def assert_steps_finite(fixture: str | os.PathLike[str], *, recipe: str | None = None,
                        recipe_args: dict[str, Any] | None = None, cwd: str | None = None,
                        snapshot_step: int | None = None, step: int | None = None,
                        num_threads: int | None = None, hyperparameters: str = "capture") -> None:
    """Re-run steps ``snapshot_step..step`` from ``fixture``; each must stay finite.

    The tests ``sentineld regress`` writes pass their JSON sidecar as ``fixture`` and nothing
    else but ``hyperparameters``: recipe, arguments, steps and threads come from it, and the project
    folder is its ``code_root`` relative to the sidecar's folder (or ``$SENTINELD_REGRESS_ROOT``),
    see :func:`read_sidecar`. Tests written before the sidecar pass everything by keyword.

    The model, optimizer, scheduler and scaler come from ``recipe`` (imported from ``cwd``, then the
    current directory, with the test's own trust: it is the user's project), loaded with the
    fixture's snapshot; each step runs with its captured batch and RNG state (CPU, ``num_threads``
    torch threads, as the replay).

    Args:
        fixture: the trimmed capture ``sentineld regress`` wrote next to the test.
        recipe: ``module:function``; recipe_args: its keyword arguments (run.json's).
        hyperparameters: ``"capture"`` keeps the optimizer settings in effect when the state was
            captured; ``"recipe"`` uses the rebuilt optimizer's own, for a fix that changes them.

    Raises:
        AssertionError: the first step whose loss, gradients after backward (before clipping and
            the optimizer step; not checked with a GradScaler, which skips such a step itself) or
            parameters after the optimizer step are non-finite; the message names the step and
            the parameters.
        ValueError: ``hyperparameters`` is neither of :data:`HYPERPARAMETER_SOURCES`.
    """
    from sentineld.replay.rebuild import load_snapshot, run_step, torch_globals  # noqa: PLC0415

    if recipe is None:
        side = read_sidecar(fixture)
        fixture, recipe, cwd = side["fixture"], side["recipe"], side["cwd"]
        recipe_args = dict(side.get("recipe_args") or {})
        snapshot_step, step, num_threads = int(side["snapshot_step"]), int(side["step"]), int(side["num_threads"])
    if recipe_args is None or cwd is None or snapshot_step is None or step is None or num_threads is None:
        raise TypeError("assert_steps_finite needs a sidecar, or recipe, recipe_args, cwd, snapshot_step, "
                        "step and num_threads")
    if hyperparameters not in HYPERPARAMETER_SOURCES:
        raise ValueError(f"HYPERPARAMETERS must be one of {HYPERPARAMETER_SOURCES}, got {hyperparameters!r}")
    with open_capture(fixture) as cap, torch_globals(num_threads):
        rec = _recipe(recipe, recipe_args, cwd)
        own = [{k: v for k, v in g.items() if k != "params"} for g in rec.optimizer.param_groups]
        load_snapshot(rec, cap.snapshot())
        if hyperparameters == "recipe":
            for group, settings in zip(rec.optimizer.param_groups, own):
                group.update(settings)
        for k in range(snapshot_step, step + 1):
            _check_step(rec, k, cap.step(k), run_step)


def _check_step(rec: Recipe, k: int, captured: Any, run_step: Any) -> None:
    """Run step ``k`` and raise AssertionError (not ``assert``: it must hold under ``python -O``)
    at the first non-finite loss, gradient or updated parameter."""
    bad_grads: list[list[str]] = []

    def on_phase(name: str) -> None:
        # Gradients as backward left them, before clipping and the optimizer step; with a
        # GradScaler an Inf gradient is the scaler's business (it skips the step).
        if name in ("clip", "optimizer") and not bad_grads and rec.scaler is None:
            bad_grads.append(_nonfinite((n, p.grad) for n, p in rec.model.named_parameters()))

    loss = run_step(rec, captured.batch, captured.rng, on_phase=on_phase)
    if not math.isfinite(loss):
        raise AssertionError(f"step {k}: the loss is {loss}")
    if bad_grads and bad_grads[0]:
        raise AssertionError(f"step {k}: non-finite gradients of {bad_grads[0]}")
    params = _nonfinite(rec.model.named_parameters())
    if params:
        raise AssertionError(f"step {k}: parameters non-finite after the optimizer step: {params}")
