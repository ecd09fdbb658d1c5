"""The one-process DDP step (replay.ddp_step) against what DDP does on each rank, computed by
hand: per-rank forward/backward with rank 0's buffers, gradients * (1/W) summed, one step."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rng import capture_rng
from sentineld.replay.ddp_step import ddp_recipe, loss_tolerance
from sentineld.replay.rebuild import run_step


def _recipe() -> Recipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Linear(6, 3))
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(world)]


def _by_hand(rec: Recipe, batches: list, rngs: list) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Each rank on its own copy from the same start (DDP: rank 0's buffers broadcast), then the
    reducer's average and the optimizer step on rank 0's copy."""
    grads, losses, copies = [], [], []
    for b, rng in zip(batches, rngs):
        m = copy.deepcopy(rec.model)
        torch.set_rng_state(rng["torch"])
        loss = rec.loss_fn(m, b)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad for n, p in m.named_parameters()})
        copies.append(m)
    world = len(batches)
    avg = {n: sum((g[n] * (1.0 / world) for g in grads[1:]), grads[0][n] * (1.0 / world)) for n in grads[0]}
    return losses, avg, dict(copies[0].named_buffers())


def test_ddp_step_is_every_rank_averaged_with_rank0_buffers() -> None:
    world = 2
    batches = _batches(world)
    torch.manual_seed(11)
    rngs = []
    for _ in range(world):
        rngs.append(capture_rng())
        torch.rand(5)  # each rank's generator is somewhere else
    rec = _recipe()
    losses, avg, buffers0 = _by_hand(rec, batches, rngs)
    before = copy.deepcopy(rec.model)
    with ddp_recipe(rec, world) as (ddp, state):
        state.begin(rngs)
        ddp.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep the grads to compare
        run_step(ddp, batches, None)
    assert state.losses == losses  # bit for bit, each rank with its own dropout mask
    for n, p in rec.model.named_parameters():
        assert torch.equal(p.grad, avg[n]), n
    for n, b in rec.model.named_buffers():
        assert torch.equal(b, buffers0[n]), n  # the next step starts from rank 0's running stats
    # The hooks are gone: a plain backward gives what it gave before (no 1/W scaling).
    for m in (rec.model, before):
        m.zero_grad()
        torch.manual_seed(3)
        rec.loss_fn(m, batches[0]).backward()
    assert torch.equal(rec.model[0].weight.grad, before[0].weight.grad)


def test_tolerance_is_zero_where_the_sum_is_exact() -> None:
    assert loss_tolerance(2, 1.5) == 0.0 and loss_tolerance(1, 1.5) == 0.0
    assert loss_tolerance(4, 2.0) == 2e-4 and loss_tolerance(8, 0.0) == 1e-6
