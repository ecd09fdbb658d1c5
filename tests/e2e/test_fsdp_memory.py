"""The ring's host-memory bound of an FSDP2 model counts each rank's local shards, not the
global parameters: on W ranks it is 1/W of the unsharded model's (it overstated W times when
it counted ``DTensor.numel()``, the global size).

One process, a real ``fully_shard`` over a 2-rank mesh on torch's in-process "fake" backend
(collectives are no-ops; the DTensors, shards and Adam state are the real ones).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from sentineld.agent.agent_config import AgentConfig
from sentineld.agent.memory import memory_bound


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # every dim 0 even: each rank holds exactly half of every tensor
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


@pytest.fixture
def two_rank_mesh() -> Iterator[object]:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_fsdp_ring_bound_counts_local_shards(two_rank_mesh: object) -> None:
    cfg = AgentConfig()
    plain = _model()
    whole = memory_bound(plain, torch.optim.Adam(plain.parameters()), cfg, False)
    sharded = _model()
    fully_shard(sharded, mesh=two_rank_mesh)
    opt = torch.optim.Adam(sharded.parameters())
    before = memory_bound(sharded, opt, cfg, False)  # Adam state estimated from the class
    n = sum(p.numel() for p in plain.parameters())
    # params + grads + two Adam moments, float32: 4 copies of 4 bytes per element
    assert whole.snapshot == 16 * n
    assert before.snapshot == whole.snapshot // 2
    sharded(torch.randn(4, 64)).sum().backward()
    opt.step()
    after = memory_bound(sharded, opt, cfg, False)  # real state now: DTensor moments + scalar steps
    steps = sum(st["step"].numel() * st["step"].element_size() for st in opt.state.values())
    assert after.snapshot == whole.snapshot // 2 + steps
    assert after.batches == whole.batches == cfg.ring_bytes
