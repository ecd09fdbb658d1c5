"""A learning rate that goes nan for one step, watched by the real agent and a real daemon: the
daemon raises one ``nonfinite`` alert naming the learning rate at the step the agent's capture
holds. On d9bb298 the capture was at step 5 but the alert came at step 7, naming only the loss (the
daemon's rule ignored lr; the nan lr made the parameters nan in step 6's update)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO, wait_until

TRAIN = """
import sys, torch, torch.nn.functional as F
from sentineld.agent import attach
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(m.parameters(), 0.1)
g = torch.Generator().manual_seed(1)
with attach(m, opt, run_id="lr-nan", runs_dir=sys.argv[1], metrics_port=0, snapshot_every=2,
            layer_every=0) as watch:
    for i in range(12):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.param_groups[0]["lr"] = float("nan") if i == 5 else 0.1  # as read after step 5
        watch.step(loss, batch=(x, y))
"""


@pytest.mark.slow
def test_nan_learning_rate_alerts_at_the_captured_step(daemon_factory):
    daemon = daemon_factory(extra=["--no-replay"])
    subprocess.run([sys.executable, "-c", TRAIN, str(daemon.runs_dir)], cwd=REPO, check=True, timeout=120)
    note = wait_until(lambda: next((n for n in daemon.notifications()
                                    if n["run"] == "lr-nan" and n["signature"] == "nonfinite"), None),
                      60, "the nonfinite alert")
    assert note["step"] == 5
    assert "learning rate lr=nan" in note["body"]
    assert [(c[1], c[2]) for c in list_captures(daemon.runs_dir / "lr-nan")] == [(5, "nonfinite")]
    time.sleep(2.0)  # once per incident
    assert [n["signature"] for n in daemon.notifications() if n["run"] == "lr-nan"] == ["nonfinite"]
