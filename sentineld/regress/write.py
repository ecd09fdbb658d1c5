"""Write a regression test for a run's offending step: a pytest file and its HDF5 fixture."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sentineld.contracts.rundir import read_run_meta

from .fixture import write_fixture
from .template import render_test

__all__ = ["Regression", "write_regression"]


@dataclass(frozen=True)
class Regression:
    """What was written: the test file, its fixture, the step it guards and the capture it came from."""

    test: Path
    fixture: Path
    step: int
    snapshot_step: int
    capture: Path
    #: Set when the guarded step's batch itself holds NaN/Inf (a data-phase fault): the test
    #: replays that batch, so it cannot pass however the code is fixed; says what to do instead.
    warning: str | None = None


def _slug(run_id: str) -> str:
    return re.sub(r"\W", "_", run_id).strip("_").lower() or "run"


def write_regression(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], step: int | None = None,
                     rank: int | None = None) -> Regression:
    """Write ``test_sentineld_<run>_step<N>.py`` and its fixture ``sentineld_<run>_step<N>.h5``.

    Args:
        run_dir: the run directory (its run.json must name a recipe).
        out_dir: where both files go (created if missing).
        step: the step to guard (default: the incident step of the capture the replay would use).
        rank: whose capture (default: the rank that went non-finite first).

    Raises:
        RunDirError: not a run directory. ValueError: the run recorded no recipe.
        ReplayError: no capture holds ``step``. CaptureError: it is not replayable from there.
        OSError: ``out_dir`` cannot be written.
    """
    from sentineld.replay import find_capture  # noqa: PLC0415 - torch

    run_dir = Path(run_dir)
    meta = read_run_meta(run_dir)
    if not meta.recipe:
        raise ValueError(f"run {meta.run_id} recorded no recipe: the regression test rebuilds the model "
                         "through it (attach(..., recipe='module:function'))")
    cap = find_capture(run_dir, step, rank)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = _slug(meta.run_id)
    probe = write_fixture(cap, out / ".sentineld-regress.h5", step)
    n = probe["step"]
    fixture = out / f"sentineld_{slug}_step{n}.h5"
    os.replace(out / ".sentineld-regress.h5", fixture)
    test = out / f"test_sentineld_{slug}_step{n}.py"
    test.write_text(render_test(run_id=meta.run_id, slug=slug, step=n, snapshot_step=probe["snapshot_step"],
                                fixture=fixture.name, recipe=meta.recipe, recipe_args=meta.recipe_args,
                                cwd=meta.cwd, num_threads=meta.num_threads))
    return Regression(test, fixture, n, probe["snapshot_step"], cap, _data_warning(fixture, n))


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
