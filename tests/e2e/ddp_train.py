"""Two-process DDP training (gloo, CPU) with the agent on every rank; rank 1's batch gets a NaN
at step NAN_STEP. Usage: python ddp_train.py RUNS_DIR RUN_ID PORT [NAN_STEP] [STEPS]"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sentineld.agent import attach
from sentineld.demo_model import load_digits_tensors, make_recipe
from dist_exit import leave  # a sibling: this script is run by path (tests/e2e is sys.path[0]), no PYTHONPATH


def worker(rank: int, world: int, runs_dir: str, run_id: str, port: int, nan_step: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    recipe = make_recipe("none")
    model = DDP(recipe.model)
    opt = recipe.optimizer
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=-1, flush_s=0.2,
                   recipe="sentineld.demo_model:make_recipe", recipe_args={"fault": "none"})
    assert watch.rank == rank
    xtr, ytr, _, _ = load_digits_tensors()
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        x, y = xtr[idx].clone(), ytr[idx]
        if rank == 1 and step == nan_step:
            x[3, 5] = float("nan")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
    watch.close()
    # barrier, destroy, os._exit (tests/e2e/dist_exit.py): a spawned child otherwise ends through
    # the interpreter's exit-time destructors, where gloo aborted rank 0 of fsdp_reload.py in CI
    leave()


if __name__ == "__main__":
    runs_dir, run_id, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nan_step = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 20
    mp.spawn(worker, args=(2, runs_dir, run_id, port, nan_step, steps), nprocs=2, join=True)
