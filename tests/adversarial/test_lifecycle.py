"""Attach, step, close: odd-but-legitimate uses of the Watch object itself."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.capture import open_capture
from sentineld.contracts.rundir import read_run_meta, valid_run_id

from .conftest import problems, stream


def _model():
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), 0.1)


def _one(m, opt):
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss, (x, y)


# ------------------------------------------------------------------ guards (pass today)
@pytest.mark.parametrize("kind", ["float", "int", "one_element", "requires_grad", "numpy_scalar",
                                  "bfloat16", "int_tensor", "shape_1x1"])
def test_loss_forms_are_recorded(tmp_path, kind):
    conv = {"float": lambda l: float(l.detach()), "int": lambda l: 3, "one_element": lambda l: l.reshape(1),
            "requires_grad": lambda l: l, "numpy_scalar": lambda l: np.float32(l.item()),
            "bfloat16": lambda l: l.bfloat16(), "int_tensor": lambda l: torch.tensor(3),
            "shape_1x1": lambda l: l.reshape(1, 1)}[kind]
    m, opt = _model()
    w = attach(m, opt, run_id="loss", runs_dir=tmp_path, metrics_port=0)
    for _ in range(3):
        loss, b = _one(m, opt)
        w.step(conv(loss), b)
    assert w.enabled
    w.close()
    steps = [o for o in stream(w.run_dir) if o["kind"] == "step"]
    assert len(steps) == 3 and all(isinstance(s["loss"], float) for s in steps)
    assert not problems(w.run_dir)


@pytest.mark.parametrize("bad", [None, "abc", [1.0], "two_elements"])
def test_unusable_loss_disables_the_agent_without_raising(tmp_path, bad):
    m, opt = _model()
    w = attach(m, opt, run_id="bad", runs_dir=tmp_path, metrics_port=0)
    loss, b = _one(m, opt)
    w.step(torch.stack([loss, loss]) if bad == "two_elements" else bad, b)
    loss, b = _one(m, opt)
    w.step(loss, b)
    assert not w.enabled
    w.close()
    assert [o["kind"] for o in stream(w.run_dir)].count("agent_error") == 1


def test_step_before_optimizer_twice_per_step_and_never(tmp_path):
    m, opt = _model()
    w = attach(m, opt, run_id="odd", runs_dir=tmp_path, metrics_port=0)
    w.step(torch.tensor(1.0))                 # before any optimizer step
    for _ in range(3):
        loss, b = _one(m, opt)
        w.step(loss, b)
        w.step(loss, b)                       # twice per step
    w.close()
    # The second call of a step is ignored with one warning (it numbered a step that never ran).
    assert w.enabled is False and [p["message"][:45] for p in problems(w.run_dir)] == [
        "watch.step called again for the same step (sa"]
    assert [o["step"] for o in stream(w.run_dir) if o["kind"] == "step"] == [0, 1, 2, 3]
    m2, opt2 = _model()
    w2 = attach(m2, opt2, run_id="never", runs_dir=tmp_path, metrics_port=0)
    for _ in range(3):
        _one(m2, opt2)                        # never calls step
    w2.close()
    assert [o["kind"] for o in stream(w2.run_dir)] == ["start", "end"]


def test_attach_twice_close_twice_and_use_after_close(tmp_path):
    m, opt = _model()
    w1 = attach(m, opt, run_id="dup", runs_dir=tmp_path, metrics_port=0)
    w2 = attach(m, opt, run_id="dup", runs_dir=tmp_path, metrics_port=0)
    assert w1.run_dir != w2.run_dir
    for _ in range(3):
        loss, b = _one(m, opt)
        w1.step(loss, b)
        w2.step(loss, b)
    w1.close()
    w1.close()
    loss, b = _one(m, opt)
    w1.step(loss, b)
    w1.capture_now()
    w2.step(loss, b)
    w2.close()
    assert len(m._forward_pre_hooks) == 0 and len(opt._optimizer_step_pre_hooks) == 0
    from sentineld.agent.exits import EXITS as _EXITS
    assert w1 not in _EXITS.watches and w2 not in _EXITS.watches
    for w in (w1, w2):
        assert not problems(w.run_dir)


def test_metrics_port_in_use_falls_back(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        m, opt = _model()
        w = attach(m, opt, run_id="port", runs_dir=tmp_path, metrics_port=busy)
        try:
            assert w.metrics_port not in (None, busy)
        finally:
            w.close()


def test_exception_in_with_block_propagates_and_writes_a_crash_capture(tmp_path):
    m, opt = _model()
    with pytest.raises(KeyError, match="boom"):
        with attach(m, opt, run_id="exc", runs_dir=tmp_path, metrics_port=0, snapshot_every=2) as w:
            for _ in range(5):
                loss, b = _one(m, opt)
                w.step(loss, b)
            raise KeyError("boom")
    assert [p.name for p in w.captures] == ["capture-rank0-step000000004-crash.h5"]
    with open_capture(w.captures[0]) as cap:
        assert "boom" in cap.message
    assert stream(w.run_dir)[-1]["reason"] == "crashed"


def test_missing_parents_of_runs_dir_are_created(tmp_path):
    m, opt = _model()
    w = attach(m, opt, run_id="deep", runs_dir=tmp_path / "a" / "b" / "c", metrics_port=0)
    w.close()
    assert (tmp_path / "a" / "b" / "c" / "deep" / "run.json").is_file()


# ------------------------------------------------------------------ breaks (fail today)
def test_reused_128_character_run_id_gets_a_valid_run_directory(tmp_path):
    """A 128-character run id is valid; re-running it must give a run directory the daemon and the
    replay accept.

    Today _unused_run_id() appends ".2" without re-checking the length: the second run is
    ``<128 chars>.2`` (130 characters), and read_run_meta() rejects its run.json ("is not a valid
    run id"), so replay and daemon refuse that run (exit 2).
    """
    rid = "r" * 128
    for _ in range(2):
        m, opt = _model()
        w = attach(m, opt, run_id=rid, runs_dir=tmp_path, metrics_port=0)
        w.close()
    assert valid_run_id(w.run_id), w.run_id
    assert read_run_meta(w.run_dir).run_id == w.run_id


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "unwritable"])
def test_unusable_runs_dir_does_not_stop_training(tmp_path, where):
    """A runs dir the agent cannot write (a file, a path under a file, a read-only or pseudo
    filesystem) is an environment problem, not a bug in the training script: ``attach`` must
    log it and return a disabled Watch whose ``step``/``close`` are no-ops, so the run goes on.

    Today attach() raises NotADirectoryError/FileNotFoundError out of make_private_dir() and the
    training script dies before its first step.
    """
    f = tmp_path / "afile"
    f.write_text("x")
    runs_dir = {"a_file": f, "under_a_file": f / "sub", "unwritable": Path("/proc/sentineld-adv/runs")}[where]
    m, opt = _model()
    w = attach(m, opt, run_id="x", runs_dir=runs_dir, metrics_port=0)
    loss, b = _one(m, opt)
    w.step(loss, b)
    w.close()
    assert not w.enabled


def test_non_json_recipe_args_are_a_clear_value_error_leaving_no_debris(tmp_path):
    """``recipe_args`` must be JSON values; a ``Path`` there should be refused with a ValueError
    naming ``recipe_args`` (attach's documented error for a bad setting), leaving nothing behind.

    Today json.dump raises a bare TypeError mid-write and a half-written ``run.json.tmp`` stays
    in a run directory that has no stream (and is silently reused by the next attach).
    """
    m, opt = _model()
    with pytest.raises(ValueError, match="recipe_args"):
        attach(m, opt, run_id="ra", runs_dir=tmp_path, metrics_port=0, recipe="train:make",
               recipe_args={"data": Path("/data")})
    assert not list(tmp_path.glob("ra/*.tmp"))
