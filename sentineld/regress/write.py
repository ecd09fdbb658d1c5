"""Write a regression test for a run's offending step: a pytest file, its JSON sidecar and its HDF5 fixture.

Before anything is written, the run is judged as ``sentineld replay`` judges it
(:mod:`sentineld.replay.trust`): run.json, the capture and every file of code the test will import
(the recipe module, or the classes and loss_fn a ``loss_fn`` run recorded, and the training
script) must be ours and writable by no one else; ``trust=True`` (``--trust``) overrides. A test
written for another user's run would import her code as whoever runs pytest.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sentineld.contracts.rundir import RunDir, RunMeta, read_run_meta
from sentineld.contracts.safeio import SafeDir

from .fixture import write_fixture
from .template import render_test

__all__ = ["Regression", "write_regression", "code_files"]


@dataclass(frozen=True)
class Regression:
    """What was written: the test file, its sidecar and fixture, the step it guards and the capture."""

    test: Path
    fixture: Path
    step: int
    snapshot_step: int
    capture: Path
    #: Set when the guarded step's batch itself holds NaN/Inf (a data-phase fault): the test
    #: replays that batch, so it cannot pass however the code is fixed; says what to do instead.
    warning: str | None = None
    sidecar: Path | None = None


def _slug(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", run_id).strip("_").lower()[:120] or "run"


def _refs(node: Any) -> Iterator[dict[str, Any]]:
    """Every class/function ref in a recorded live recipe (``{"module", "qualname", "script"}``)."""
    if isinstance(node, dict):
        if isinstance(node.get("module"), str) and "qualname" in node:
            yield node
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def code_files(recipe: str, args: dict[str, Any], cwd: Path) -> list[Path]:
    """The files of code a test of this recipe imports from the project, to be checked."""
    from sentineld.replay.live_recipe import LIVE_RECIPE  # noqa: PLC0415
    from sentineld.replay.trust import recipe_files  # noqa: PLC0415

    if recipe != LIVE_RECIPE:
        return recipe_files(recipe.partition(":")[0], cwd)
    files: list[Path] = []
    for ref in _refs(args):
        script = ref.get("script") or ref.get("file")
        if ref.get("module") == "__main__" and script:
            path = Path(script) if Path(script).is_absolute() else cwd / script
            cache = path.parent / "__pycache__"
            files += [path, path.parent, *([cache, *cache.glob(f"{path.stem}.*.pyc")] if cache.is_dir() else [])]
        else:
            files += recipe_files(str(ref["module"]), cwd)
    return [f for f in dict.fromkeys(files) if f.exists()]


def _relative_scripts(node: Any, cwd: Path) -> Any:
    """``node`` with absolute script paths made relative to ``cwd`` (the test
    resolves them against its own project folder)."""
    if isinstance(node, dict):
        out = {k: _relative_scripts(v, cwd) for k, v in node.items()}
        for key in ("script", "file"):
            if isinstance(out.get(key), str) and Path(out[key]).is_absolute():
                out[key] = os.path.relpath(out[key], cwd)
        return out
    if isinstance(node, list):
        return [_relative_scripts(v, cwd) for v in node]
    return node


def write_regression(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], step: int | None = None,
                     rank: int | None = None, *, trust: bool = False) -> Regression:
    """Write ``test_sentineld_<run>_step<N>.py``, its sidecar ``sentineld_<run>_step<N>.json`` and
    fixture ``sentineld_<run>_step<N>.h5``.

    Args:
        run_dir: the run directory (its run.json names a recipe, or recorded a ``loss_fn`` run's
            live objects).
        out_dir: where the files go (created if missing).
        step: the step to guard (default: the incident step of the capture the replay would use).
        rank: whose capture (default: the rank that went non-finite first).
        trust: write even when the run's files or code are not safely ours (``--trust``).

    Raises:
        RunDirError: not a run directory. ValueError: the run recorded no way to rebuild it.
        UntrustedError: a file the test would import, run.json or the capture is another user's
            or writable by others (nothing is written).
        ReplayError: no capture holds ``step``. CaptureError: it is not replayable from there.
        OSError: ``out_dir`` cannot be written.
    """
    from sentineld.contracts.trust import check_chain, check_owned  # noqa: PLC0415
    from sentineld.replay import find_capture  # noqa: PLC0415 - torch
    from sentineld.replay.live_recipe import recipe_of  # noqa: PLC0415

    run_dir = Path(run_dir)
    meta = read_run_meta(run_dir)
    found = recipe_of(meta)
    if found is None:
        raise ValueError(f"run {meta.run_id} recorded no recipe and no loss_fn: the regression test rebuilds "
                         "the model through one (attach(..., loss_fn=...) or recipe='module:function')")
    recipe, args = found
    cap = find_capture(run_dir, step, rank)
    cwd = Path(meta.cwd)
    if not trust:
        for f in [run_dir / RunDir.RUN_JSON, cap, *code_files(recipe, args, cwd)]:
            check_owned(f)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not trust:
        # pytest imports what sits next to the test (conftest.py, a module named like one the
        # test imports): in a folder others may write (a sticky /tmp too) they could add one, or
        # plant test_*.py as a link to a file of ours for this write to go through.
        check_chain(out, leaf_allow_sticky=False)
    with SafeDir.open(out, follow=True) as d:  # a folder the user named; every write below is relative to it
        return _write_files(d, out, meta, recipe, args, cap, cwd, step)


def _write_files(d: SafeDir, out: Path, meta: RunMeta, recipe: str, args: dict[str, Any], cap: Path,
                 cwd: Path, step: int | None) -> Regression:
    """Fixture, sidecar and test in ``d`` (the safe writer: no planted link or file is written through)."""
    from sentineld.replay.live_recipe import LIVE_RECIPE  # noqa: PLC0415

    slug = _slug(meta.run_id)
    probe = write_fixture(cap, out / ".sentineld-regress.h5", step, at=d)
    n = probe["step"]
    stem = f"sentineld_{slug}_step{n}"
    fixture = out / f"{stem}.h5"
    d.rename(".sentineld-regress.h5", fixture.name)
    if recipe == LIVE_RECIPE:
        args = _relative_scripts({k: v for k, v in args.items() if k != "root"}, cwd)
    sidecar = out / f"{stem}.json"
    side = {"written_by": "sentineld regress", "run_id": meta.run_id, "step": n,
            "snapshot_step": probe["snapshot_step"], "fixture": fixture.name, "recipe": recipe,
            "recipe_args": args, "code_root": os.path.relpath(cwd.resolve(), out.resolve()),
            "num_threads": meta.num_threads}
    d.write(sidecar.name, json.dumps(side, indent=1, allow_nan=False) + "\n", mode=0o644, durable=False)
    test = out / f"test_{stem}.py"
    d.write(test.name, render_test(sidecar.name), mode=0o644, durable=False)
    return Regression(test, fixture, n, probe["snapshot_step"], cap, _data_warning(fixture, n), sidecar)


def _data_warning(fixture: Path, step: int) -> str | None:
    """A warning when the batch of ``step`` in ``fixture`` holds a non-finite float (see Regression)."""
    import torch  # noqa: PLC0415

    from sentineld.contracts.capture import open_capture  # noqa: PLC0415

    with open_capture(fixture) as cap:
        batch = cap.step(step).batch
    bad: list[bool] = []

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex():
                bad.append(not bool(torch.isfinite(x).all()))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(batch)
    if not any(bad):
        return None
    return (f"the batch of step {step} itself holds NaN/Inf (a data fault): this test replays that batch, "
            "so it cannot pass however the model code is fixed. Guard the data instead (e.g. "
            "torch.isfinite(x).all() in the data pipeline), or keep this test only for the loss/model "
            "handling of bad batches (e.g. a skip) you add.")
