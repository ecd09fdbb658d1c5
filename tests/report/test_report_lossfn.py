"""Issue 22, the report of a plain loop attached with ``loss_fn`` (no recipe): activations of the
incident's own batch, the verdict's one-line summaries, the dead share after a NaN marked
non-finite, log axes for values spanning decades. Fails on 49179bb ("activations unavailable: the
run recorded no recipe", no op inputs/output rows, a dead share of 1.0 at the NaN steps)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from sentineld.report import data as d
from sentineld.report.figures import _scale
from sentineld.report.sources import read_records
from tests.regress import lossfn_project as lp


@pytest.mark.slow
def test_report_of_a_loss_fn_run(tmp_path: Path) -> None:
    project = lp.write_project(tmp_path / "project")
    run = lp.train(project, tmp_path / "runs", STEPS="12", CLOSE_WAIT_S="240")
    run_dir = run["run_dir"]
    verdict = next(run_dir.glob("*.verdict.json"))
    out = tmp_path / "report.html"
    r = subprocess.run([sys.executable, "-m", "sentineld", "report", str(run_dir), "--verdict", str(verdict),
                        "-o", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert "activations unavailable" not in page
    assert f"one forward of the incident step {lp.NAN_STEP}&#x27;s batch" in page
    assert "<td>op inputs</td>" in page and "<td>op output</td>" in page and "NaN 0, +Inf" in page
    assert f"<td>samples</td><td>[{lp.BAD_ROW}]" in page

    # A new user's path: no daemon, no --verdict; the agent's own verdict.json is shown (it said
    # "no replay verdict for this run" before, though the verdict lay next to the capture).
    plain = tmp_path / "plain.html"
    r = subprocess.run([sys.executable, "-m", "sentineld", "report", str(run_dir), "-o", str(plain),
                        "--no-activations"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    plain_page = plain.read_text()
    assert "no replay verdict" not in plain_page
    assert f"<td>samples</td><td>[{lp.BAD_ROW}]" in plain_page

    records, _ = read_records(run_dir, 0)
    nan_steps = {rec.step for rec in records if not math.isfinite(rec.loss)}
    assert nan_steps and min(nan_steps) == lp.NAN_STEP
    grid = d.dead_or_saturated_grid(records)
    for j, step in enumerate(grid.steps):
        col = grid.values[:, j][~grid.missing[:, j]]
        if int(step) in nan_steps:
            assert not np.isfinite(col).any(), (step, col)  # marked non-finite, not "100 % dead"


def test_values_spanning_decades_get_a_log_axis_with_few_labels() -> None:
    fig, axes = plt.subplots(3, 1)
    _scale(axes[0], np.array([0.6, 1e-3, 1e-8]))
    _scale(axes[1], np.array([0.6, 0.0, 1e-8]))  # a zero: symlog, not a flat line at 0
    _scale(axes[2], np.array([0.6, 0.5, 0.4]))
    assert [ax.get_yscale() for ax in axes] == ["log", "symlog", "linear"]
    axes[0].set_ylim(1e-8, 1)
    fig.canvas.draw()
    labels = [t for t in axes[0].get_yticklabels() if t.get_text() and 1e-8 <= t.get_position()[1] <= 1]
    assert 2 <= len(labels) <= 7
    plt.close(fig)
