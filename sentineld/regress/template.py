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
is fixed it passes. Run it with pytest from the project's working directory. It imports only
sentineld.regress.assert_steps_finite, the stable name of that check.

HYPERPARAMETERS: "capture" keeps the optimizer settings (lr, eps, betas, ...) that were in effect
when the state was captured; set it to "recipe" when the fix is a change of those settings in the
recipe, so the rebuilt optimizer's own settings are used.
"""

import json
from pathlib import Path

from sentineld.regress import assert_steps_finite

FIXTURE = Path(__file__).with_name($fixture_repr)
RECIPE = $recipe_repr
RECIPE_ARGS = json.loads($args_repr)
RUN_CWD = $cwd_repr
SNAPSHOT_STEP = $snapshot_step
STEP = $step
NUM_THREADS = $num_threads
HYPERPARAMETERS = "capture"


def test_run_${slug}_step_${step}_stays_finite():
    assert_steps_finite(FIXTURE, recipe=RECIPE, recipe_args=RECIPE_ARGS, cwd=RUN_CWD,
                        snapshot_step=SNAPSHOT_STEP, step=STEP, num_threads=NUM_THREADS,
                        hyperparameters=HYPERPARAMETERS)
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
