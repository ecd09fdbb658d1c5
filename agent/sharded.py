"""FSDP2 (``fully_shard``) runs: local shards on the hot path, one DCP checkpoint per capture.

A ``fully_shard`` model's parameters, gradients and Adam moments are DTensors: each rank holds
one shard (``Shard(0)`` on a 1-D mesh). The agent never unshards on the hot path:

- the step's grad norm (:func:`sentineld.agent.readback.grad_norm`) and the per-layer probes
  take the rank's local shards (:func:`local`): no collective per step. The recorded
  ``grad_norm`` of a rank is the L2 norm of its shards; the run's global grad norm is
  ``sqrt(sum over ranks of grad_norm**2)`` (run.json ``extra.grad_norm = "local_shard"`` says
  so to readers). The non-finite check is exact: a non-finite element sits in some rank's shard,
  that rank opens the incident, and :mod:`.peers` makes every other rank capture the step.
- a snapshot copies each rank's local shards to host (:func:`to_host_sharded`), with the layout
  (global shape, stride, placements) to rebuild the DTensor later: the host memory is the
  shard's, 1/W of the parameter.
- a capture writes the snapshot's shards with ``torch.distributed.checkpoint`` (DCP) from every
  rank together (:class:`ShardedSaver`), on a gloo process group of the agent's own, made at
  attach, so the capture thread's collectives never interleave with training's. The HDF5
  capture keeps the rest (:mod:`sentineld.contracts.dcpstate`).

Limits (stated, checked): a 1-D mesh over all ranks of the job (plain FSDP; HSDP / TP meshes are
not captured: the capture is skipped with a warning); every rank must capture the same
incidents in the same order (they do: the same step through the store); the snapshot cadence is
fixed (the auto cadence is per rank, and the ranks' shards must come from the same step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from sentineld.contracts.dcpstate import dcp_dir_name, split_sharded

from .ring import to_host_sized

__all__ = ["is_dtensor", "local", "model_is_sharded", "HostShard", "to_host_sharded", "ShardedSaver",
           "sharded_saver"]

log = logging.getLogger("sentineld.agent")

#: Seconds a capture's DCP collectives wait for the other ranks before the capture fails.
SAVE_TIMEOUT_S = 120


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    """True for a DTensor (a sharded parameter, gradient or optimizer moment)."""
    tp = _dtensor_type()
    return tp is not None and isinstance(x, tp)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a DTensor; any other tensor as it is (no copy, no collective)."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def model_is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter of ``model`` is a DTensor (``fully_shard`` ran on it)."""
    tp = _dtensor_type()
    return tp is not None and any(isinstance(p, tp) for p in model.parameters())


@dataclass
class HostShard:
    """One rank's shard of a DTensor, copied to host, with what rebuilds the DTensor.

    Attributes:
        local: the local shard (host memory; async from CUDA: wait on the snapshot's event).
        shape, stride: the global (unsharded) shape and stride.
        placements: the DTensor's placements (``(Shard(0),)`` under FSDP2).
        mesh_ndim: dimensions of its device mesh (only 1 is captured).
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[Any, ...]
    mesh_ndim: int


def to_host_sharded(tree: Any) -> tuple[Any, int]:
    """``(host copy of tree, bytes)``: DTensor leaves become :class:`HostShard` (their local shard
    only; bytes count the shard), every other tensor a host copy as :func:`.ring.to_host_sized`."""
    total = 0

    def walk(x: Any) -> Any:
        nonlocal total
        if is_dtensor(x):
            shard, n = to_host_sized(x.to_local().detach())
            total += n
            return HostShard(shard, tuple(x.shape), tuple(x.stride()), tuple(x.placements), x.device_mesh.ndim)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(walk(v) for v in x)
        if isinstance(x, torch.Tensor):
            out, n = to_host_sized(x)
            total += n
            return out
        return x

    return walk(tree), total


class ShardedSaver:
    """Writes a snapshot's shards as one DCP checkpoint, with every other rank (the capture thread).

    Args:
        group: a gloo process group over all ranks, this agent's own (made at attach).
        rank: this rank.
    """

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self.rank = group, rank
        self._mesh: Any = None

    def save(self, run_dir: Path, step: int, trigger: str, snapshot_step: int,
             state: Any) -> tuple[Any, str]:
        """Save ``state``'s :class:`HostShard` leaves; return ``(state with placeholders, dir name)``.

        Collective over :attr:`group`: every rank calls it for the same incident. The checkpoint
        is written under a temporary name and renamed by rank 0 once every rank's shard and the
        metadata are on disk (DCP's finish step), so a checkpoint directory is whole or absent.

        Raises:
            ValueError: a shard of a multi-dimensional mesh (HSDP, TP: not captured).
            RuntimeError: a peer did not join within :data:`SAVE_TIMEOUT_S` (gloo's timeout).
        """
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        plain, shards = split_sharded(state, lambda x: isinstance(x, HostShard))
        if any(s.mesh_ndim != 1 for s in shards.values()):
            raise ValueError("a DTensor on a multi-dimensional device mesh (HSDP or tensor parallel) is "
                             "not captured; only plain FSDP2 (a 1-D mesh) is")
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, "cpu")
        # Host shards as DTensors on a CPU mesh over the agent's gloo group: DCP takes each
        # shard's global offsets from its placements, and writes host memory (no device copy).
        sd = {k: DTensor.from_local(s.local, self._mesh, s.placements, run_check=False, shape=s.shape,
                                    stride=s.stride) for k, s in shards.items()}
        name = dcp_dir_name(step, trigger, snapshot_step)
        tmp = run_dir / f".{name}.tmp"
        dcp.save(sd, checkpoint_id=str(tmp), process_group=self.group)
        if self.rank == 0:
            os.chmod(tmp, 0o700)  # DCP made it with the umask's mode; the run dir's files are private
            os.replace(tmp, run_dir / name)
        return plain, name


def sharded_saver(model: torch.nn.Module, rank: int, world: int) -> ShardedSaver | None:
    """A :class:`ShardedSaver` for a sharded model in a multi-rank job, else None.

    Collective (``new_group``): every rank's ``attach`` calls it, as every rank attaches.
    """
    if world <= 1 or not model_is_sharded(model):
        return None
    dist = torch.distributed
    if not dist.is_initialized():
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SAVE_TIMEOUT_S))
    return ShardedSaver(group, rank)
