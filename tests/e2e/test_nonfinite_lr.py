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


SCHEDULED = """
import sys, time, torch, torch.nn.functional as F
from sentineld.agent import attach
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(m.parameters(), 0.1)
# a warm-up written as 1 / (30 - s): 1/0 = inf once the scheduler has stepped 30 times (after step 29)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (30 - s) if s != 30 else float("inf"))
g = torch.Generator().manual_seed(1)
with attach(m, opt, run_id="lr-inf", runs_dir=sys.argv[1], metrics_port=0, scheduler=sched,
            localize="off", capture_on_sigterm=False) as watch:
    for i in range(36):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        watch.step(loss, batch=(x, y))
        time.sleep(0.02)  # followed live by the daemon
"""


@pytest.mark.slow
def test_scheduler_inf_learning_rate_alert_names_the_lr_at_the_captured_step(daemon_factory):
    """The issue's case: the stream has lr=inf at step 29, the capture is at 29; the alert must say
    so, not "loss=nan, grad_norm=nan at step 31" (the loss goes nan two updates later)."""
    daemon = daemon_factory(extra=["--no-replay"])
    subprocess.run([sys.executable, "-c", SCHEDULED, str(daemon.runs_dir)], cwd=REPO, check=True, timeout=120)
    note = wait_until(lambda: next((n for n in daemon.notifications()
                                    if n["run"] == "lr-inf" and n["signature"] == "nonfinite"), None),
                      60, "the nonfinite alert")
    assert [(c[1], c[2]) for c in list_captures(daemon.runs_dir / "lr-inf")] == [(29, "nonfinite")]
    assert note["step"] == 29
    first_line = note["body"].splitlines()[0]
    assert first_line.startswith("non-finite learning rate lr=inf at step 29"), first_line
    assert "loss=nan" not in first_line
