"""An internal error must be logged once and switch the agent off, never reach the training loop."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.agent import recorder as recorder_module
from sentineld.agent.recorder import StepRecorder

from .conftest import stream


def _loop(m, opt, w, steps=4, dtype=torch.float32):
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 4, dtype=dtype), torch.randint(0, 2, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        w.step(loss, batch=(x, y))
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("where", ["grad_norm", "take_snapshot", "record"])
def test_internal_error_in_any_hook_never_raises_into_the_loop(tmp_path, monkeypatch, caplog, where):
    """Whatever agent code fails (optimizer step pre-hook, forward pre-hook, watch.step), training
    goes on with the same losses, the error is logged once and ``enabled`` becomes False.

    Today a failure inside the optimizer step pre-hook crashes training: _disable() removes the
    hook from ``optimizer._optimizer_step_pre_hooks`` while ``Optimizer.step`` is iterating over
    that dict, so the loop gets "RuntimeError: OrderedDict mutated during iteration".
    """
    def boom(*a, **k):
        raise RuntimeError("injected agent failure")

    torch.manual_seed(0)
    ref_m = nn.Linear(4, 2)
    ref_opt = torch.optim.SGD(ref_m.parameters(), 0.1)
    torch.manual_seed(1)
    ref = [None] * 4
    for i in range(4):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref_m(x), y)
        loss.backward()
        ref_opt.step()
        ref[i] = loss.item()

    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    # grad_norm is the readback function the optimizer step pre-hook calls (agent/readback.py);
    # take_snapshot runs in the forward pre-hook, record in watch.step (agent/recorder.py).
    monkeypatch.setattr(recorder_module if where == "grad_norm" else StepRecorder, where, boom)
    w = attach(m, opt, run_id="boom", runs_dir=tmp_path, metrics_port=0)
    torch.manual_seed(1)
    try:
        with caplog.at_level(logging.ERROR, logger="sentineld.agent"):
            losses = _loop(m, opt, w)
        enabled = w.enabled
    finally:
        w.close()
    assert losses == ref
    assert not enabled
    assert sum("disabled" in r.getMessage() for r in caplog.records) == 1
    assert [o["kind"] for o in stream(w.run_dir)].count("agent_error") == 1


def test_float64_training_is_not_crashed_by_the_agent(tmp_path):
    """A float64 model is legitimate; attaching must not break its loop.

    Today the grad-norm pre-hook fails on float64 grads and the disable path then raises
    "OrderedDict mutated during iteration" out of ``optimizer.step()``.
    """
    torch.manual_seed(0)
    m = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    w = attach(m, opt, run_id="f64", runs_dir=tmp_path, metrics_port=0)
    try:
        losses = _loop(m, opt, w, dtype=torch.float64)
        enabled = w.enabled
    finally:
        w.close()
    assert enabled  # still recording: the agent did not switch itself off
    steps = [o for o in stream(w.run_dir) if o["kind"] == "step"]
    assert [o["step"] for o in steps] == [0, 1, 2, 3]
    # the stream holds the loss as float32 (the agent reads losses back as float32 scalars)
    assert [o["loss"] for o in steps] == [float(torch.tensor(v, dtype=torch.float64).float()) for v in losses]
    assert all(o["grad_norm"] > 0 for o in steps)
    assert [o["kind"] for o in stream(w.run_dir)].count("agent_error") == 0


def test_probes_switching_off_say_so_in_the_stream_once(tmp_path, monkeypatch):
    """The layer probes switch themselves off on an internal error (training and the rest of the
    agent go on). Before, the reason went to the log only, so `sentineld status` never showed why
    dead-unit and per-layer signatures had gone quiet; now one agent_warning with the first line
    of the error (torch's dispatcher errors run to kilobytes) is in the stream."""
    from sentineld.agent import probes as probes_module

    def boom(self, *args, **kwargs):  # whatever _collect takes: it raises
        raise RuntimeError("Could not run 'aten::amax' with arguments from the 'SparseCPU' backend.\n"
                           + "CPU: registered at ...\n" * 200)

    monkeypatch.setattr(probes_module.ProbeHandle, "_collect", boom)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id="probes-off", runs_dir=tmp_path, metrics_port=0, localize="off")
    _loop(m, opt, w, steps=6)
    w.close()
    warnings = [r for r in stream(w.run_dir) if r.get("kind") == "agent_warning"]
    assert len(warnings) == 1, warnings
    msg = warnings[0]["message"]
    assert msg.startswith("layer probes switched off after an internal error: RuntimeError: Could not run")
    assert len(msg) < 400 and "registered at" not in msg
    steps = [r for r in stream(w.run_dir) if r.get("kind", "step") == "step"]
    assert len(steps) == 6  # every step still recorded
