"""Reload an FSDP2 capture's DCP checkpoint into a model sharded over this job's ranks.

Usage: torchrun --nproc-per-node W fsdp_reload.py CHECKPOINT_DIR OUT.pt

Every rank loads its own shards (DCP reshards from the checkpoint's offsets, whatever world size
wrote it) into the model of :func:`tests.e2e.fsdp_faults_train.sharded_recipe`; rank 0 saves the
reloaded parameters, gathered whole, to OUT.pt (the test compares them with the run's).
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.e2e.dist_exit import leave
from tests.e2e.fsdp_faults_train import sharded_recipe


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model, _opt = sharded_recipe(dist.get_world_size())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()  # nothing of the recipe's own weights may survive the load
    sd = {f"model/{n}": p for n, p in model.named_parameters()}
    dcp.load(sd, checkpoint_id=ckpt)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"world_size": dist.get_world_size(), "params": full}, out)
    leave()


if __name__ == "__main__":
    main()
