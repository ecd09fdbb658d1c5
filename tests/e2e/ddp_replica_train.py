"""DDP training (gloo, CPU) started by torchrun with the agent's replica check on every rank.

Usage: torchrun --nproc-per-node W ddp_replica_train.py RUNS_DIR JOB CHANGE_RANK CHANGE_STEP STEPS

Two segments: ``<job>-clean`` (replicas stay equal) and ``<job>-silent``: after the optimizer step
of CHANGE_STEP, CHANGE_RANK adds 1e-4 to one element of ``fc1.weight`` of its replica, in place,
silently (nothing non-finite; DDP never compares parameters after construction).
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sentineld.agent import attach
from tests.e2e.ddp_model import batch_for, make_recipe
from tests.e2e.dist_exit import leave


def segment(runs_dir: str, run_id: str, change: bool, change_rank: int, change_step: int, steps: int) -> None:
    rank = dist.get_rank()
    recipe = make_recipe()
    model = DDP(recipe.model)
    opt = recipe.optimizer
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=0, flush_s=0.2,
                   snapshot_every=4, layer_every=0, recipe="tests.e2e.ddp_model:make_recipe")
    for step in range(steps):
        batch = batch_for(rank, step, None, 0, 0)
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss_fn(model, batch)
        loss.backward()
        opt.step()
        if change and rank == change_rank and step == change_step:
            with torch.no_grad():
                recipe.model.fc1.weight[2, 3] += 1e-4
        watch.step(loss, batch=batch)
    watch.close()
    dist.barrier()


def main() -> None:
    runs_dir, job = sys.argv[1], sys.argv[2]
    change_rank, change_step, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    segment(runs_dir, f"{job}-clean", False, change_rank, change_step, steps)
    segment(runs_dir, f"{job}-silent", True, change_rank, change_step, steps)
    leave()


if __name__ == "__main__":
    main()
