"""preflight works on copies: the caller's model, optimizer, gradients and RNG states are bitwise
unchanged afterwards, though the checks trained, zeroed gradients and changed learning rates."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sentineld.preflight import check


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def test_model_optimizer_and_rng_states_are_bitwise_unchanged(tmp_path) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 20, generator=g)
    y = (x @ torch.randn(20, 5, generator=g)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)  # iterating draws torch RNG

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    for batch in loader:  # Adam state and .grad exist before the preflight
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    random.seed(1)
    np.random.seed(2)
    params = list(model.parameters())
    before = {"model": copy.deepcopy(model.state_dict()), "grads": [p.grad.clone() for p in params],
              "opt": copy.deepcopy(opt.state_dict()), "torch": torch.get_rng_state(),
              "numpy": np.random.get_state(), "random": random.getstate(), "training": model.training}

    checks = check(model, opt, loss_fn, loader, lr_range=True, lr_plot=tmp_path / "lr.png")

    by = {c.name: c for c in checks}
    assert by["overfit_one_batch"].evidence["steps"] > 0 and by["lr_range"].evidence["points"] > 10
    _assert_same(before["model"], model.state_dict(), "model")
    _assert_same(before["grads"], [p.grad for p in params], "grads")
    _assert_same(before["opt"], opt.state_dict(), "optimizer")
    assert opt.param_groups[0]["lr"] == 1e-2
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params))
    _assert_same(before["torch"], torch.get_rng_state(), "torch RNG")
    _assert_same(list(before["numpy"]), list(np.random.get_state()), "numpy RNG")
    assert before["random"] == random.getstate()
    assert model.training is before["training"]


def test_rng_restored_when_the_users_code_raises() -> None:
    torch.manual_seed(5)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(8, 4)]
    state = torch.get_rng_state()

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        torch.rand(3)  # consumes RNG, then fails
        raise RuntimeError("boom in the user's loss")

    checks = check(model, opt, loss_fn, batches)
    assert torch.equal(state, torch.get_rng_state())
    failed = [c for c in checks if c.status == "FAIL"]
    # the first check that runs the loss fails with the error; the later ones raising the same
    # error are blocked by it (one thing to fix), not a copy of the traceback each
    assert [c.name for c in failed] == ["output_vs_loss"]
    assert "boom in the user's loss" in failed[0].message
    blocked = {c.name for c in checks if c.status == "SKIP"}
    assert {"gradient_flow", "overfit_one_batch"} <= blocked
    assert all(c.evidence["blocked_by"] == "output_vs_loss" for c in checks if c.name in blocked)


def test_preflight_on_a_model_the_agent_watches_leaves_the_watch_alone(tmp_path) -> None:
    """The agent's hooks on model, optimizer and a parameter are not copied into (nor fired by)
    the preflight's copies: the watch sees no extra forward or optimizer step."""
    from sentineld.agent import attach

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 20, generator=g)
    y = (x @ torch.randn(20, 5, generator=g)).argmax(1)
    batches = [(x[:32], y[:32]), (x[32:], y[32:])]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    with attach(model, opt, run_id="pf", runs_dir=tmp_path, metrics_port=0) as watch:
        for b in batches:
            opt.zero_grad()
            loss = loss_fn(model, b)
            loss.backward()
            opt.step()
            watch.step(loss, batch=b)
        hooks = (dict(model._forward_pre_hooks), dict(opt._optimizer_step_pre_hooks))
        stream = sorted(tmp_path.rglob("*.jsonl"))
        before = [p.read_bytes() for p in stream]
        checks = check(model, opt, loss_fn, batches)
        assert (dict(model._forward_pre_hooks), dict(opt._optimizer_step_pre_hooks)) == hooks
        assert len(hooks[0]) >= 1 and len(hooks[1]) >= 1  # the agent's hooks are still on the model
        opt.zero_grad()
        loss = loss_fn(model, batches[0])
        loss.backward()
        opt.step()
        watch.step(loss, batch=batches[0])  # the watch still works after the preflight
    assert [c for c in checks if c.status == "FAIL"] == []
    assert stream and [p.read_bytes()[: len(b)] for p, b in zip(stream, before)] == before
    steps = [json.loads(line).get("step") for line in stream[0].read_text().splitlines() if line.strip()]
    assert steps.count(2) <= 1 and max(s for s in steps if s is not None) == 2


def test_two_runs_give_the_same_verdicts() -> None:
    from tests.preflight.zoo import HEALTHY

    case = next(c for c in HEALTHY if c.name == "layernorm_gelu_dropout")  # dropout draws RNG
    runs = []
    for _ in range(2):
        model, opt, loss_fn, batches, extra = case.build()
        runs.append([(c.name, c.status, c.message) for c in check(model, opt, loss_fn, batches, **extra)])
    assert runs[0] == runs[1]
