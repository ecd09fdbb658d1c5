"""The auto snapshot cadence counts the on-disk ring's snapshot write beside the training
thread's copy (issue 23: a 9.5 MiB MLP + Adam snapshot file took ~4.4 ms of the writer's CPU,
and the cadence, budgeting the copy alone, snapshotted every 10 steps of a 5-ms step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sentineld.agent import attach
from sentineld.agent.agent_config import AgentConfig
from sentineld.agent.snapshots import SnapshotSchedule


def _tuned(copy_s: float, disk_s: float, step_s: float = 0.005) -> int:
    sched = SnapshotSchedule(AgentConfig())
    sched.taken(copy_s)
    for _ in range(20):
        sched.step_time(step_s)
    sched.tune(0, disk_s)
    return sched.every


def test_the_disk_write_of_a_snapshot_counts_against_the_budget():
    cfg = AgentConfig()
    # copy 0.2 ms at a 1% budget of 5 ms: ceil(0.2 / 0.05) = 4 -> the floor, min_snapshot_every
    assert _tuned(0.0002, 0.0) == cfg.min_snapshot_every
    # plus a 4.4 ms file: ceil(4.6 / 0.05) = 92 steps between snapshots
    assert _tuned(0.0002, 0.0044) == 92
    # and never past half the window (the ring must hold a whole span)
    assert _tuned(0.0002, 0.5) == cfg.window // 2


def test_a_disk_ring_run_hands_its_snapshot_write_cost_to_the_cadence(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    w = attach(model, opt, run_id="cadence", runs_dir=tmp_path, metrics_port=0, disk_ring=True)
    sched, calls = w._rec.schedule, []
    tune = sched.tune

    def observed(nbytes: int, disk_cost_s: float = 0.0) -> None:  # records what the agent passes
        calls.append(disk_cost_s)
        tune(nbytes, disk_cost_s)
    sched.tune = observed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(120):
            x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss, batch=(x, y))
        w._rec.disk.flush()
        assert w._rec.disk.snapshot_cost_s > 0.0  # the writer measured its newest snapshot file
        # every 16 steps the agent re-derived the cadence, and once the writer had written a
        # snapshot file, with that file's cost (the first tunes come before any file is written)
        assert len(calls) >= 7 and calls[-1] > 0.0, calls
    finally:
        w.close()
