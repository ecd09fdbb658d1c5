"""DDP training (gloo, CPU) started by torchrun, the agent attached on every rank, one fault
planted per segment. Each segment trains a fresh model under its own run id
``<job>-<fault>`` for ``steps`` steps; the fault sits in ``fault_rank``'s batch at ``fault_step``.

Usage: torchrun --nproc-per-node W ddp_faults_train.py RUNS_DIR JOB FAULT_RANK FAULT_STEP STEPS FAULT...
(FAULT: one of ``tests.e2e.ddp_model.FAULTS``.) With JOB ``@elastic`` one segment runs under the
run id the agent takes from the torchrun job, and in the job's first attempt every rank raises
after step 2 (so torchrun, given ``--max-restarts 1``, restarts the job).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sentineld.agent import attach
from tests.e2e.ddp_model import batch_for, make_recipe
from tests.e2e.dist_exit import leave


def segment(runs_dir: str, run_id: str, fault: str, fault_rank: int, fault_step: int, steps: int) -> None:
    rank = dist.get_rank()
    recipe = make_recipe()
    model = DDP(recipe.model)
    opt = recipe.optimizer
    watch = attach(model, opt, run_id=run_id or None, runs_dir=runs_dir, metrics_port=0, flush_s=0.2,
                   snapshot_every=4, layer_every=0, recipe="tests.e2e.ddp_model:make_recipe")
    for step in range(steps):
        batch = batch_for(rank, step, fault, fault_rank, fault_step)
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss_fn(model, batch)
        loss.backward()
        opt.step()
        watch.step(loss, batch=batch)
        if not run_id and step == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            # The job fails (every rank raises, so none waits in a collective for a dead peer);
            # torchrun restarts every rank as a new attempt.
            raise RuntimeError("planted failure of the first attempt")
    watch.close()
    dist.barrier()


def main() -> None:
    runs_dir, job = sys.argv[1], sys.argv[2]
    fault_rank, fault_step, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if job == "@elastic":
        # The job's store under a prefix of this attempt: torch's own worker store keeps the first
        # attempt's gloo addresses, and a restarted attempt connects to dead peers (seen with torch
        # 2.13 on this machine without sentineld: "Gloo connectFullMesh failed ... Connection refused").
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"test/attempt{attempt}", base),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for fault in sys.argv[6:]:
        segment(runs_dir, "" if job == "@elastic" else f"{job}-{fault}", fault, fault_rank, fault_step, steps)
    leave()


if __name__ == "__main__":
    main()
