"""Inputs a real user produces that broke the agent (breaker pass): a lazy module not yet
initialized at attach, a nested-tensor batch, and finite batches whose float32 sum overflows."""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.capture import open_capture

from .conftest import problems, stream


def _train(tmp_path, model, make_batch, name, nan_at=None, steps=6):
    """Train ``steps`` steps of a 4 -> 2 classifier; returns (watch, step records)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = attach(model, opt, run_id=name, runs_dir=tmp_path / "runs", metrics_port=0)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if i == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        w.step(loss, batch=make_batch(x, y))
    w.close()
    return w, [o for o in stream(w.run_dir) if o["kind"] == "step"]


def test_lazy_linear_not_initialized_at_attach_is_watched_and_captured(tmp_path):
    # attach raised ValueError("Attempted to use an uninitialized parameter ...") into the loop;
    # then the attach snapshot and the step-0 snapshot (taken before the lazy forward) disabled it.
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    w, recs = _train(tmp_path, model, lambda x, y: (x, y), "lazy", nan_at=3)
    assert not problems(w.run_dir), problems(w.run_dir)
    assert [r["step"] for r in recs] == list(range(6))
    assert len(w.captures) == 1
    with open_capture(w.captures[0]) as cap:
        assert cap.step(3).batch[0].shape == (8, 4)


def test_nested_tensor_batch_keeps_the_agent_enabled(tmp_path):
    # hasattr(nested, "shape") raises RuntimeError, which disabled the agent at the first step.
    model = nn.Linear(4, 2)
    w, recs = _train(tmp_path, model, lambda x, y: torch.nested.nested_tensor([x[:3], x[:5]]), "nested")
    assert not problems(w.run_dir), problems(w.run_dir)
    assert len(recs) == 6 and all(r["input_nonfinite"] is None for r in recs)


def test_finite_batch_whose_float32_sum_overflows_is_not_called_nonfinite(tmp_path):
    # An additive attention mask of finfo(float32).min sums to -inf: every step was marked
    # input_nonfinite and a false incident capture was written at step 0.
    mask = torch.full((8, 8), torch.finfo(torch.float32).min)
    w, recs = _train(tmp_path, nn.Linear(4, 2), lambda x, y: {"x": x, "mask": mask, "y": y}, "mask")
    assert [r["input_nonfinite"] for r in recs] == [False] * 6
    assert w.captures == []


def test_float64_features_above_float32_range_are_not_called_nonfinite(tmp_path):
    w, recs = _train(tmp_path, nn.Linear(4, 2), lambda x, y: (x.double() * 1e300, y), "f64")
    assert [r["input_nonfinite"] for r in recs] == [False] * 6
    assert w.captures == []


def test_a_real_inf_next_to_an_overflowing_mask_is_still_called_nonfinite(tmp_path):
    mask = torch.full((8, 8), torch.finfo(torch.float32).min)

    def batch(x, y):
        x = x.clone()
        if batch.n == 2:
            x[0, 0] = float("inf")
        batch.n += 1
        return {"x": x, "mask": mask}
    batch.n = 0
    w, recs = _train(tmp_path, nn.Linear(4, 2), batch, "maskinf")
    assert [r["input_nonfinite"] for r in recs] == [False, False, True, False, False, False]


def test_watch_step_called_twice_per_step_records_each_step_once(tmp_path):
    # Each second call was recorded as a step of its own with optimizer_skipped=True: half the
    # run looked like skipped optimizer steps and every step number was doubled.
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id="twice", runs_dir=tmp_path / "runs", metrics_port=0)
    for _ in range(4):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        w.step(loss, batch=(x, y))
        w.step(loss, batch=(x, y))
    w.close()
    recs = [o for o in stream(w.run_dir) if o["kind"] == "step"]
    assert [(r["step"], r["optimizer_skipped"]) for r in recs] == [(i, False) for i in range(4)]
    warns = [p["message"] for p in problems(w.run_dir)]
    assert len(warns) == 1 and "watch.step called again for the same step" in warns[0]


def test_a_skipped_optimizer_step_with_a_new_loss_is_still_recorded(tmp_path):
    # The duplicate rule must not drop a real step whose optimizer step did not run.
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id="skip", runs_dir=tmp_path / "runs", metrics_port=0)
    for i in range(4):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        if i != 2:
            opt.step()
        w.step(loss, batch=(x, y))
    w.close()
    recs = [o for o in stream(w.run_dir) if o["kind"] == "step"]
    assert [(r["step"], r["optimizer_skipped"]) for r in recs] == [(0, False), (1, False), (2, True), (3, False)]


class _SparseRelu(nn.Module):
    """torch.relu on a sparse COO activation in the forward (sparse features of a recommender)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.o(torch.relu(h.to_sparse()).to_dense() + F.relu(h))


def test_a_sparse_activation_leaves_the_layer_probes_on(tmp_path):
    # NotImplementedError("Could not run 'aten::gt.Scalar' ... 'SparseCPU'") switched every
    # layer probe off for the rest of the run (no dead-unit, no parameter-norm figures).
    w, recs = _train(tmp_path, _SparseRelu(), lambda x, y: (x, y), "sparse_act", steps=3)
    assert not problems(w.run_dir), problems(w.run_dir)
    # Dense early sampling: every one of the first steps has its figures.
    assert all(r["layers"] and r["layers"]["a"]["param_norm"] is not None for r in recs), recs
    assert [r["layers"][""]["dead_fraction"] for r in recs] == [0.0, 0.0, 0.0]  # the dense F.relu


@pytest.mark.parametrize("kind", ["set", "bytes", "enum_key", "csr"])
def test_an_unstorable_batch_leaf_costs_that_leaf_not_the_capture(tmp_path, kind):
    # "capture not written: cannot store set at /s in a capture ...": the incident's capture
    # (state, records, batch) was lost for one leaf of the batch.
    makers = {"set": lambda x, y: {"x": x, "s": {1, 2}}, "bytes": lambda x, y: {"x": x, "raw": b"\x00"},
              "enum_key": lambda x, y: {_Key.A: x, "x": x}, "csr": lambda x, y: {"x": x, "c": x.to_sparse_csr()}}
    w, recs = _train(tmp_path, nn.Linear(4, 2), makers[kind], f"leaf_{kind}", nan_at=3)
    assert not problems(w.run_dir), problems(w.run_dir)
    assert len(w.captures) == 1
    with open_capture(w.captures[0]) as cap:
        batch = cap.step(3).batch
    assert torch.equal(batch["x"], makers[kind](*_batch_at(3))["x"])
    assert any(isinstance(v, str) and v.startswith("<not stored:") for v in (*batch.values(), *batch.keys()))


class _Key(enum.Enum):
    A = 1


def _batch_at(i):
    g = torch.Generator().manual_seed(1)
    for _ in range(i + 1):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    return x, y


@pytest.mark.parametrize("kind", ["holds_itself", "meta_tensor"])
def test_a_batch_the_agent_cannot_walk_costs_the_batch_not_the_agent(tmp_path, kind):
    # RecursionError / NotImplementedError("Cannot copy out of meta tensor") disabled the agent
    # at the first step: no records, no capture for the rest of the run.
    def holds_itself(x, y):
        d = {"x": x}
        d["me"] = d
        return d

    makers = {"holds_itself": holds_itself, "meta_tensor": lambda x, y: (x, torch.empty(3, device="meta"))}
    w, recs = _train(tmp_path, nn.Linear(4, 2), makers[kind], f"walk_{kind}", nan_at=3)
    assert [r["step"] for r in recs] == list(range(6)) and len(w.captures) == 1
    msgs = [p["message"] for p in problems(w.run_dir)]
    assert len(msgs) == 1 and msgs[0].startswith("batch not kept (the step is recorded without it)")
