"""Copies of the live training objects for the in-process replay (replay.inmemory)."""

from __future__ import annotations

import torch
from torch import nn

from sentineld.agent import attach
from sentineld.agent.localize_live import state_bytes
from sentineld.replay.inmemory import LiveSpec, copy_module


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # weight tying
        self.seen = 0
        self.register_forward_pre_hook(self._count)  # a hook of the user's, bound to the module

    def _count(self, module: nn.Module, args: tuple) -> None:
        self.seen += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_copy_keeps_structure_tying_and_user_hooks_but_not_sentineld_hooks(tmp_path):
    live = Tied()
    opt = torch.optim.Adam(live.parameters())
    watch = attach(live, opt, runs_dir=tmp_path, metrics_port=0, loss_fn=lambda m, b: m(b).sum())
    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    live_hooks = dict(live._forward_pre_hooks)
    assert len(live_hooks) == 3  # the user's, the agent's step start, its sampled-step activation probe

    cp = copy_module(live)
    assert cp is not live and cp.head.weight is cp.emb.weight and cp.emb.weight is not live.emb.weight
    assert len(cp._forward_pre_hooks) == 1  # the agent's hook is not copied
    cp.load_state_dict(live.state_dict())
    cp.train()
    cp(torch.tensor([1, 2]))
    assert cp.seen == 1 and live.seen == 0  # the user's hook was re-bound to the copy
    assert dict(live._forward_pre_hooks) == live_hooks
    for n, p in live.named_parameters():
        assert torch.equal(p, before[n])
    watch.close()


def test_live_spec_builds_an_optimizer_of_the_same_class_and_groups():
    live = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": live[0].parameters(), "lr": 0.1},
                           {"params": live[1].parameters(), "lr": 0.01, "momentum": 0.9}], lr=0.5)
    rec = LiveSpec(live, opt, lambda m, b: m(b).sum()).make()
    assert type(rec.optimizer) is torch.optim.SGD
    assert [g["lr"] for g in rec.optimizer.param_groups] == [0.1, 0.01]
    assert rec.optimizer.param_groups[1]["momentum"] == 0.9
    assert rec.optimizer.param_groups[0]["params"][0] is rec.model[0].weight
    rec.optimizer.param_groups[0]["lr"] = 7.0
    assert opt.param_groups[0]["lr"] == 0.1  # the live groups are never written
    assert state_bytes(rec.model) == state_bytes(live) == (12 + 4) * 4


class NeedsBeta(torch.optim.SGD):
    def __init__(self, params, beta, lr=0.1):  # a required argument the param groups do not hold
        super().__init__(params, lr=lr)
        self.beta = beta


def test_optimizer_with_required_constructor_argument_is_copied():
    import pytest

    from sentineld.replay.inmemory import copy_optimizer

    live = nn.Linear(2, 2)
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match=r"not parameters of the model \(shapes \[\(3,\)\]\).*recipe="):
        LiveSpec(live, torch.optim.SGD(list(live.parameters()) + [stray], lr=0.1), lambda m, b: 0).make()
    # A required constructor argument the param groups do not hold (failed on 49179bb): the
    # copy is made without the constructor, with the live object's own attributes.
    opt = NeedsBeta(live.parameters(), beta=0.5, lr=0.25)
    opt.param_groups[0]["momentum"] = 0.0
    cp = nn.Linear(2, 2)
    got = copy_optimizer(opt, {id(a): b for a, b in zip(live.parameters(), cp.parameters())})
    assert type(got) is NeedsBeta and got.beta == 0.5 and got.param_groups[0]["lr"] == 0.25
    assert [p for g in got.param_groups for p in g["params"]] == list(cp.parameters())
    assert got.state == {} and got.param_groups[0] is not opt.param_groups[0]
    got.param_groups[0]["lr"] = 1.0
    assert opt.param_groups[0]["lr"] == 0.25  # the live groups are never written
    cp.weight.grad = torch.ones_like(cp.weight)
    before, live_before = cp.weight.detach().clone(), live.weight.detach().clone()
    got.step()  # a working optimizer: the copy's parameter moved, the live one did not
    assert not torch.equal(cp.weight.detach(), before) and torch.equal(live.weight.detach(), live_before)
