"""The text of the pytest file ``sentineld regress`` writes (a template filled with the run's facts)."""

from __future__ import annotations

import json
from string import Template

__all__ = ["render_test"]

_TEST = Template('''"""Regression test for run $run_id, step $step, written by `sentineld regress`.

The fixture $fixture holds the captured training state before step $snapshot_step (model,
optimizer, scheduler, scaler) and the batches and RNG states of steps $snapshot_step..$step. The
test rebuilds the model through the recipe $recipe, loads that state and re-runs those steps;
every one must stay finite: the loss, the gradients after the backward pass and the parameters
after the optimizer step. On the code that ran the incident it fails by step $step; once the bug
is fixed it passes. Run it with pytest from the project's working directory.

HYPERPARAMETERS: "capture" keeps the optimizer settings (lr, eps, betas, ...) that were in effect
when the state was captured; set it to "recipe" when the fix is a change of those settings in the
recipe, so the rebuilt optimizer's own settings are used.
"""

import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

from sentineld.contracts.capture import open_capture
from sentineld.replay.rebuild import load_snapshot, run_step, torch_globals

FIXTURE = Path(__file__).with_name($fixture_repr)
RECIPE = $recipe_repr
RECIPE_ARGS = json.loads($args_repr)
RUN_CWD = $cwd_repr
SNAPSHOT_STEP = $snapshot_step
STEP = $step
NUM_THREADS = $num_threads
HYPERPARAMETERS = "capture"


def _recipe():
    for path in (RUN_CWD, os.getcwd()):  # the working directory comes first
        if path not in sys.path:
            sys.path.insert(0, path)
    module, _, function = RECIPE.partition(":")
    return getattr(importlib.import_module(module), function)(**RECIPE_ARGS)


def _nonfinite(named):
    return [name for name, t in named if t is not None and not bool(torch.isfinite(t).all())]


def test_run_${slug}_step_${step}_stays_finite():
    with open_capture(FIXTURE) as cap, torch_globals(NUM_THREADS):
        rec = _recipe()
        settings = [{k: v for k, v in g.items() if k != "params"} for g in rec.optimizer.param_groups]
        load_snapshot(rec, cap.snapshot())
        if HYPERPARAMETERS == "recipe":
            for group, own in zip(rec.optimizer.param_groups, settings):
                group.update(own)
        for step in range(SNAPSHOT_STEP, STEP + 1):
            captured = cap.step(step)
            grads = {}

            def on_phase(name):
                # Gradients as backward left them, before clipping and the optimizer step; with a
                # GradScaler an Inf gradient is the scaler's business (it skips the step).
                if name in ("clip", "optimizer") and "bad" not in grads and rec.scaler is None:
                    grads["bad"] = _nonfinite((n, p.grad) for n, p in rec.model.named_parameters())

            loss = run_step(rec, captured.batch, captured.rng, on_phase=on_phase)
            assert math.isfinite(loss), f"step {step}: the loss is {loss}"
            assert not grads.get("bad"), f"step {step}: non-finite gradients of {grads['bad']}"
            params = _nonfinite(rec.model.named_parameters())
            assert not params, f"step {step}: parameters non-finite after the optimizer step: {params}"
''')


def render_test(*, run_id: str, slug: str, step: int, snapshot_step: int, fixture: str, recipe: str,
                recipe_args: dict, cwd: str, num_threads: int) -> str:
    """The pytest file's text.

    Args:
        slug: ``run_id`` as a Python identifier fragment (the test function's name).
        fixture: the fixture's file name, next to the test file.
        recipe: ``module:function``; recipe_args: its JSON keyword arguments; cwd: the run's
            working directory (also put on ``sys.path``); num_threads: the run's torch threads.
    """
    return _TEST.substitute(
        run_id=run_id, slug=slug, step=step, snapshot_step=snapshot_step, fixture=fixture,
        fixture_repr=repr(fixture), recipe=recipe, recipe_repr=repr(recipe),
        args_repr=repr(json.dumps(recipe_args)), cwd_repr=repr(cwd), num_threads=int(num_threads))
