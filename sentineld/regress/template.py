"""The text of the pytest file ``sentineld regress`` writes, and the JSON sidecar it reads.

The test file is constant text except one name: its sidecar's file name, a ``repr``-quoted string
of ``[A-Za-z0-9_.]`` checked by parsing the result (:func:`render_test`). Everything about the run
(recipe, its arguments, the project folder, steps, threads) is in the sidecar JSON, read by
:func:`sentineld.regress.assert_steps_finite` when the test runs, so no value of the run ever
becomes Python source (a recipe string holding ``\"\"\"`` and a statement stays a string).
"""

from __future__ import annotations

import ast
import re

__all__ = ["render_test", "SIDECAR_NAME"]

#: What a sidecar's file name may hold (the slug of a run id, a step number, the suffix).
SIDECAR_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}\.json")

_HEAD = '''"""Regression test written by `sentineld regress`: a captured training incident must not come back.

The JSON file named below (next to this file) says which run and step this guards and how to
rebuild the model (the recipe, or the model, optimizer and loss_fn the run recorded); the HDF5
fixture next to it holds the training state before the first replayed step and the batches and
RNG states up to the offending one. The test rebuilds the model, loads that state and re-runs those
steps: each must stay finite (the loss, the gradients after backward, the parameters after the
optimizer step). It fails on the code that ran the incident and passes once the bug is fixed.

Moving it: keep the .py, .json and .h5 files together. The project's code is found at "code_root"
in the JSON, a path relative to this file's folder (written as the run's working directory as
seen from here); after moving the files elsewhere in the repository, edit "code_root", or set
SENTINELD_REGRESS_ROOT to the project folder (CI: the checkout's root).

HYPERPARAMETERS: "capture" keeps the optimizer settings (lr, eps, betas, ...) in effect when the
state was captured; set "recipe" when the fix is a change of those settings, so the rebuilt
optimizer's own are used.
"""

from pathlib import Path

from sentineld.regress import assert_steps_finite

'''

_TAIL = '''HYPERPARAMETERS = "capture"


def test_captured_step_stays_finite():
    assert_steps_finite(SIDECAR, hyperparameters=HYPERPARAMETERS)
'''


def render_test(sidecar: str) -> str:
    """The pytest file's text for the sidecar file ``sidecar`` (a name, next to the test).

    Raises:
        ValueError: ``sidecar`` is not a plain file name (:data:`SIDECAR_NAME`), or the text does
            not parse back to that one literal (never interpolated code).
    """
    if not SIDECAR_NAME.fullmatch(sidecar):
        raise ValueError(f"sidecar name {sidecar!r} must match {SIDECAR_NAME.pattern}")
    text = _HEAD + f"SIDECAR = Path(__file__).with_name({sidecar!r})\n" + _TAIL
    consts = [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if sidecar not in consts:
        raise ValueError("the rendered test does not hold the sidecar name as a literal")
    return text
