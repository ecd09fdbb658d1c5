"""The Watch methods framework callbacks call (begin_step, grads_ready, start_at), in a real loop
shaped like Lightning's: the model is never called as a module, forward and backward run inside
``optimizer.step(closure)``, and the framework draws random numbers and steps the LR scheduler
between one step's record and the next step's start."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sentineld.agent import attach
from sentineld.contracts.capture import open_capture
from sentineld.contracts.snapshot import MODEL, SCHEDULER


def _setup(tmp_path, run_id: str, **kw):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    watch = attach(m, opt, run_id=run_id, runs_dir=tmp_path, metrics_port=0, scheduler=sched, **kw)
    return m, opt, sched, watch


def _closure_loop(m, opt, sched, watch, steps: int) -> dict[str, list]:
    """Train ``steps`` steps; return per step the RNG state and parameters at its start and the
    norm of its fresh gradients."""
    g = torch.Generator().manual_seed(1)
    seen: dict[str, list] = {"rng": [], "params": [], "norm": []}
    for _ in range(steps):
        torch.rand(3)  # the framework's own draw (a sampler) after the previous step's record
        seen["rng"].append(torch.get_rng_state().clone())
        seen["params"].append(m.weight.detach().clone())
        watch.begin_step()
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)

        def closure(x=x, y=y):
            opt.zero_grad()
            out = F.linear(F.dropout(x, 0.5, training=True), m.weight, m.bias)  # not m(x): no hook
            loss = F.mse_loss(out, y)
            loss.backward()
            seen["norm"].append(float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in m.parameters()]))))
            watch.grads_ready()  # after the optimizer's pre-hook, which saw last step's gradients
            return loss

        loss = opt.step(closure)
        watch.step(loss, (x, y))
        sched.step()  # after the record, before the next step starts
    return seen


def _steps(watch) -> list[dict]:
    lines = [json.loads(x) for x in (watch.run_dir / "stream-rank0.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "step"]


def test_grads_ready_records_the_gradients_the_closure_made(tmp_path):
    m, opt, sched, watch = _setup(tmp_path, "closure")
    seen = _closure_loop(m, opt, sched, watch, 6)
    watch.close()
    # The optimizer's own pre-hook ran before the closure: without grads_ready the record would
    # hold the previous step's norm (and no gradients at all at step 0).
    assert [r["grad_norm"] for r in _steps(watch)] == pytest.approx(seen["norm"], rel=1e-6)


def test_begin_step_snapshots_and_reads_rng_where_the_framework_starts_the_step(tmp_path):
    m, opt, sched, watch = _setup(tmp_path, "begin", snapshot_every=5)
    seen = _closure_loop(m, opt, sched, watch, 8)
    watch.capture_now()
    watch.close()
    with open_capture(watch.captures[0]) as cap:
        s = cap.snapshot_step
        assert s == 5 and cap.steps == [5, 6, 7]
        snap = cap.snapshot()
        # The state before step 5 includes the scheduler step and the draw between steps 4 and 5.
        assert torch.equal(snap[MODEL]["weight"], seen["params"][s])
        assert snap[SCHEDULER]["last_epoch"] == s
        for k in cap.steps:
            assert torch.equal(cap.step(k).rng["torch"], seen["rng"][k]), k


def test_start_at_numbers_the_steps_from_the_trainers_global_step(tmp_path):
    m, opt, sched, watch = _setup(tmp_path, "resumed", snapshot_every=5)
    watch.start_at(40)
    _closure_loop(m, opt, sched, watch, 3)
    watch.capture_now()
    with pytest.raises(ValueError, match="before the first step"):
        watch.start_at(0)  # renumbering would break the ring's step order
    watch.close()
    assert [r["step"] for r in _steps(watch)] == [40, 41, 42]
    with open_capture(watch.captures[0]) as cap:
        assert cap.snapshot_step == 40 and cap.steps == [40, 41, 42]


def test_start_at_refuses_a_negative_step(tmp_path):
    _, _, _, watch = _setup(tmp_path, "negative")
    with pytest.raises(ValueError, match=">= 0"):
        watch.start_at(-1)
    watch.close()
