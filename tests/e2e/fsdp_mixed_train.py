"""FSDP2 training in mixed precision: every unit ``fully_shard``-ed with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (the usual FSDP2 recipe),
started by torchrun on a CPU mesh (gloo), the agent attached on every rank, one fault planted per
segment (the batches of :mod:`tests.e2e.ddp_model`).

Usage: torchrun --nproc-per-node W fsdp_mixed_train.py RUNS_DIR JOB FAULT_RANK FAULT_STEP STEPS FAULT...

The model is this module's (the test model of ddp_model has a BatchNorm, whose float32 running
statistics CPU batch_norm refuses beside bfloat16 inputs); the replay builds it with
``tests.e2e.fsdp_mixed_train:make_recipe``.
"""

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe

#: The policy of every unit (root, fc1, head).
PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32


class Net(nn.Module):
    """``(B, 8) -> (B, 4)``: Linear, Tanh, Linear; fc1 and head are units, the root holds none."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc1(x)))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Sample-weighted mean cross-entropy (float32) of the bfloat16 logits, ``batch = (x, y, w)``."""
    x, y, w = batch
    return (F.cross_entropy(model(x).float(), y, reduction="none") * w).mean()


def make_recipe(seed: int = 0) -> Recipe:
    """Net + Adam (lr 1e-2), seeded: every rank and the replay start from the same weights."""
    torch.manual_seed(seed)
    model = Net()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                  num_classes=4)


def sharded_mixed(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model, fc1, head and the root each ``fully_shard``-ed with the bfloat16 policy,
    and Adam over its DTensors."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    model = make_recipe().model
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    for unit in (model.fc1, model.head, model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def main() -> None:
    from tests.e2e.dist_exit import leave  # noqa: PLC0415
    from tests.e2e.fsdp_faults_train import segment  # noqa: PLC0415

    runs_dir, job = sys.argv[1], sys.argv[2]
    fault_rank, fault_step, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for fault in sys.argv[6:]:
        segment(runs_dir, f"{job}-{fault}", fault, fault_rank, fault_step, steps, build=sharded_mixed,
                recipe="tests.e2e.fsdp_mixed_train:make_recipe", loss=loss_fn)
    leave()


if __name__ == "__main__":
    main()
