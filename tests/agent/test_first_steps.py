"""A fault in the first steps, before a periodic snapshot: the agent still captures it and the
replay names the optimizer step and the parameters it made non-finite (issue 10, detection gap 1).

The loop calls a model method (``training_loss``), not ``model(x)``, as much research code does:
the agent's forward pre-hook never fires, and on main before this fix its first snapshot was taken
at the end of step 0, after the optimizer had already made the parameters nan. The capture of the
nan loss at step 1 then started from that corrupt snapshot and the replay could not see the fault
(and a fault seen at step 0 itself got "no clean snapshot in the ring; capture skipped"). Now the
agent snapshots at attach, before step 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO

TRAIN = """
import sys, torch, torch.nn.functional as F
from sentineld.agent import attach
from tests.agent.first_step_recipe import make
bad, method, layer_every = int(sys.argv[2]), sys.argv[3] == "method", int(sys.argv[4])
rec = make(bad)
g = torch.Generator().manual_seed(1)
with attach(rec.model, rec.optimizer, run_id="first", runs_dir=sys.argv[1], metrics_port=0,
            recipe="tests.agent.first_step_recipe:make", recipe_args={"bad_step": bad},
            localize="off", layer_every=layer_every, capture_on_sigterm=False) as watch:
    for i in range(bad + 5):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        rec.optimizer.zero_grad()
        loss = rec.model.training_loss(x, y) if method else F.cross_entropy(rec.model(x), y)
        loss.backward()
        rec.optimizer.step()
        watch.step(loss, batch=(x, y))
"""


def _train_and_replay(tmp_path, bad_step: int, loop: str, layer_every: int) -> tuple[list, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path), str(bad_step), loop, str(layer_every)],
                   cwd=REPO, check=True, timeout=120, env=env)
    run_dir = tmp_path / "first"
    caps = [(c[1], c[2]) for c in list_captures(run_dir)]
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run_dir), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return caps, json.loads(out.stdout)


@pytest.mark.parametrize("loop,layer_every,seen_at", [
    ("method", 0, 1),    # seen in step 1's nan loss: the capture must start before step 0
    ("forward", 0, 1),   # the plain loop (model(x)): the first forward's snapshot
    ("forward", 1, 0),   # sampled step 0 shows nan parameters: capture at step 0 itself
])
def test_optimizer_fault_at_step_0_is_captured_and_replayed(tmp_path, loop, layer_every, seen_at):
    caps, report = _train_and_replay(tmp_path, 0, loop, layer_every)
    assert caps == [(seen_at, "nonfinite")]
    assert report["step"] == 0
    assert report["phase"] == "optimizer"
    assert report["reproduced"] is True
    assert sorted(report["parameters"]) == ["a.bias", "a.weight", "b.bias", "b.weight"]


def test_optimizer_fault_before_the_first_periodic_snapshot(tmp_path):
    """Step 3 of a method loop: the capture starts at the attach snapshot and rebuilds steps 0-2."""
    caps, report = _train_and_replay(tmp_path, 3, "method", 0)
    assert caps == [(4, "nonfinite")]
    assert (report["step"], report["phase"]) == (3, "optimizer")


def test_attach_snapshot_is_renumbered_by_start_at_and_replaced_by_the_first_step(tmp_path):
    """The ring bound holds: the attach snapshot is one of the ring's two, never a third."""
    import torch
    import torch.nn.functional as F

    from sentineld.agent import attach

    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    watch = attach(m, opt, run_id="renum", runs_dir=tmp_path, metrics_port=0, localize="off",
                   snapshot_every=10, capture_on_sigterm=False)
    assert [s.step for s in watch._ring.snapshots] == [0]
    watch.start_at(100)
    assert [s.step for s in watch._ring.snapshots] == [100]
    with torch.no_grad():
        m.weight.fill_(0.5)  # a checkpoint loaded after attach: the first step's snapshot has it
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(m(torch.ones(3, 4)), torch.zeros(3, 2))
        loss.backward()
        opt.step()
        watch.step(loss, batch=torch.ones(3, 4))
    (snap,) = watch._ring.snapshots
    assert snap.step == 100 and float(snap.state["model"]["weight"].flatten()[0]) == 0.5
    watch.close()
