"""Who and where a run is: rank, run id, the model inside wrappers, the numerics flags."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import torch

from sentineld.contracts.fsdpunits import UNITS_KEY, record_units
from sentineld.contracts.rundir import valid_run_id

__all__ = ["dist_rank", "default_run_id", "job_attempt", "unwrap", "is_compiled", "model_kind", "torch_flags"]

log = logging.getLogger("sentineld.agent")


def dist_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torch.distributed or the launcher's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def default_run_id() -> str:
    """The run id when ``attach`` got none: ``$SENTINELD_RUN_ID``, else the torchrun job's
    ``$TORCHELASTIC_RUN_ID`` (the rendezvous id, shared by every rank of the job; torchrun's
    placeholder ``none`` for a job started without ``--rdzv-id`` becomes
    ``torchrun-<master addr>-<master port>``, which every rank of that job shares too), else
    ``<time>-<host>-<pid>`` (one process)."""
    env = os.environ
    if env.get("SENTINELD_RUN_ID") and valid_run_id(env["SENTINELD_RUN_ID"]):
        return env["SENTINELD_RUN_ID"]
    job = env.get("TORCHELASTIC_RUN_ID", "")
    if job == "none" and env.get("MASTER_PORT"):
        job = f"torchrun-{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}"
    if job and job != "none" and valid_run_id(job):
        return job
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"


def job_attempt(run_id: str) -> str:
    """``run_id``, or ``run_id-attempt<N>`` in the N-th restart of a torchrun (elastic) job.

    A restarted job (``$TORCHELASTIC_RESTART_COUNT`` > 0) restarts every rank from its last
    checkpoint, not from where the old attempt stopped: its steps repeat the old attempt's
    numbers, so it is a new run. Every rank of the attempt reads the same count, so they agree.
    """
    try:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return run_id
    if attempt <= 0:
        return run_id
    suffix = f"-attempt{attempt}"
    return run_id[: 128 - len(suffix)] + suffix


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose state_dict a plain recipe model loads: inside DDP/DP/FSDP and
    ``torch.compile`` wrappers (not any module that merely has a child named ``module``)."""
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415

        wrappers += (FullyShardedDataParallel,)
    except ImportError:
        pass
    while True:
        if isinstance(model, wrappers):
            model = model.module  # type: ignore[assignment]  # a wrapper holds a Module
        elif (type(model).__name__ == "OptimizedModule"
              and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def model_kind(model: torch.nn.Module, sharded: bool) -> dict[str, Any]:
    """run.json fields saying how the model runs: ``compiled`` (a ``torch.compile`` wrapper was
    attached: the replay runs it eagerly), its ``compile_backend``, ``sharded`` (``"fsdp2"``:
    parameters are DTensors) and ``grad_norm`` (``"local_shard"``: each rank's recorded grad norm
    is the L2 norm of its own shards; the global one is ``sqrt(sum over ranks of its square)``) and,
    for a sharded model, ``fsdp_units`` (every FSDP unit and its mixed-precision policy, for the
    replay to shard and compute as the run did: :mod:`sentineld.contracts.fsdpunits`)."""
    compiled = _compiled(model)
    backend = _backend_name(compiled.dynamo_ctx) if compiled is not None else None
    kind: dict[str, Any] = {"compiled": compiled is not None, "compile_backend": backend,
            "sharded": "fsdp2" if sharded else None, "grad_norm": "local_shard" if sharded else "global"}
    if sharded:
        kind[UNITS_KEY] = record_units(unwrap(model))
    return kind


def is_compiled(model: torch.nn.Module) -> bool:
    """True when ``model`` is (or wraps) a ``torch.compile`` module (``OptimizedModule``)."""
    return _compiled(model) is not None


def _compiled(model: torch.nn.Module) -> Any:
    m: Any = model
    while m is not None:
        if type(m).__name__ == "OptimizedModule":
            return m
        m = getattr(m, "module", None) if isinstance(m, torch.nn.Module) else None
    return None


def _backend_name(ctx: Any) -> str | None:
    """The backend's name (``inductor``, ``aot_eager``...) of a dynamo context: dynamo wraps the
    backend in callables that each keep the one inside as ``_torchdynamo_orig_backend``."""
    obj = getattr(ctx, "callback", None)
    for _ in range(8):
        if obj is None:
            return None
        name = getattr(obj, "compiler_name", None) or getattr(obj, "__name__", None)
        if isinstance(name, str) and name not in ("callback", "__call__"):
            return name
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None


def torch_flags() -> dict[str, Any]:
    """Process-wide settings a step's numerics depend on; the replay applies them."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
