"""FSDP2 training (``fully_shard`` on a CPU device mesh, gloo) started by torchrun, the agent
attached on every rank, one fault planted per segment (the faults and the model of
:mod:`tests.e2e.ddp_model`). Each segment trains a fresh model under the run id ``<job>-<fault>``.

Usage: torchrun --nproc-per-node W fsdp_faults_train.py RUNS_DIR JOB FAULT_RANK FAULT_STEP STEPS FAULT...

``fc1`` and ``head`` are each their own FSDP unit, the rest (``norm``, ``bn``) is the root's:
every parameter and Adam moment is a DTensor sharded over the ranks.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sentineld.agent import attach
from tests.e2e.ddp_model import batch_for, loss_fn, make_recipe
from tests.e2e.dist_exit import leave


#: The step whose starting parameters are saved whole (``<run id>.truth.pt`` beside the run dir).
TRUTH_STEP = 4


def sharded_recipe(world: int):  # noqa: ANN201 - the test's own helper
    """The recipe's model sharded as the test shards it, and Adam over its DTensors."""
    recipe = make_recipe()
    model = recipe.model
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def segment(runs_dir: str, run_id: str, fault: str, fault_rank: int, fault_step: int, steps: int,
            build=sharded_recipe, recipe: str = "tests.e2e.ddp_model:make_recipe",  # noqa: ANN001
            loss=loss_fn) -> None:  # noqa: ANN001 - the test's own helper
    """One run: ``build(world)`` gives the sharded model and its optimizer, ``recipe`` names the
    replay's recipe, ``loss(model, batch)`` the loss; the batches of :func:`batch_for`."""
    rank = dist.get_rank()
    model, opt = build(dist.get_world_size())
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=0, flush_s=0.2,
                   snapshot_every=4, layer_every=0, recipe=recipe)
    for step in range(steps):
        if step == TRUTH_STEP:  # the whole parameters before the snapshot's step, for the reload tests
            full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
            if rank == 0:
                torch.save(full, f"{runs_dir}/{run_id}.truth.pt")
        batch = batch_for(rank, step, fault, fault_rank, fault_step)
        opt.zero_grad(set_to_none=True)
        loss_value = loss(model, batch)
        loss_value.backward()
        opt.step()
        watch.step(loss_value, batch=batch)
    watch.close()

    dist.barrier()


def main() -> None:
    runs_dir, job = sys.argv[1], sys.argv[2]
    fault_rank, fault_step, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for fault in sys.argv[6:]:
        segment(runs_dir, f"{job}-{fault}", fault, fault_rank, fault_step, steps)
    leave()


if __name__ == "__main__":
    main()
