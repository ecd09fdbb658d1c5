"""Building the agent's parts at attach: argument checks, the metrics exporter, the on-disk ring,
run.json's localization fields. Each never raises for an environment problem (a busy port, an
unwritable ring directory): that part is switched off with a warning and training goes on."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from sentineld.contracts.records import AGENT_WARNING, AgentNotice
from sentineld.contracts.rundir import RunDirError, read_run_meta, valid_run_id, write_run_meta
from sentineld.contracts.stream import StreamWriter

from .agent_config import AgentConfig
from .diskring import DiskRingWriter
from .exporter import Latest, start_exporter
from .localize_live import LiveLocalizer
from .runinfo import default_run_id, job_attempt

__all__ = ["check_args", "run_extra", "start_metrics", "start_disk_ring", "record_metrics_port"]

log = logging.getLogger("sentineld.agent")


def check_args(model: Any, optimizer: Any, run_id: str | None, recipe: str | None,
               recipe_args: dict[str, Any] | None) -> str:
    """The run id to use.

    Raises:
        TypeError: model or optimizer of the wrong type.
        ValueError: a bad run id, recipe spec or non-JSON recipe_args (the message names it).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    run_id = job_attempt(run_id or default_run_id())  # a restarted torchrun attempt is a new run
    if not valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
    if recipe is not None and ":" not in recipe:
        raise ValueError(f"recipe must be 'module:function', got {recipe!r}")
    try:
        json.dumps(dict(recipe_args or {}), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"recipe_args must be JSON values (str, numbers, bools, lists, dicts): {exc}") from None
    return run_id


def check_signatures(signatures: Any) -> dict[str, dict[str, Any]]:
    """``attach(signatures=...)``, checked as the daemon will read it (run.json ``extra``).

    Raises:
        ValueError: not a mapping of signature id to settings, an unknown signature or key, or
            a bad value (the message names it; docs/signatures.md lists them).
    """
    from sentineld.signatures import SignatureConfig  # noqa: PLC0415

    try:
        SignatureConfig.from_mapping(signatures)
        out = {str(k): dict(v) for k, v in signatures.items()}
        json.dumps(out)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"attach(signatures=...): {exc} (see docs/signatures.md)") from None
    return out


def run_extra(live: LiveLocalizer | None, localize: str, inner: torch.nn.Module) -> dict[str, Any]:
    """run.json's in-process localization fields (read by the daemon and the forward-only replay)."""
    # What rebuilds the run without a recipe (`sentineld replay`, `report`, `regress`); resolves
    # the localizer's ``auto`` mode, so it comes first.
    rebuild = live.recorded() if live is not None else {}
    out = {"localize": live.mode if live else "off",
           "localize_memory_bytes": live.memory_bytes if live else 0,
           "model_class": f"{type(inner).__module__}:{type(inner).__qualname__}"}
    return {**out, **rebuild}


def start_metrics(config: AgentConfig, latest: Latest, run_id: str, rank: int, local_rank: int,
                  enabled: bool) -> tuple[Any, int | None]:
    """``(server, bound port)`` of the Prometheus exporter, or ``(None, None)`` when off/unbindable."""
    if config.metrics_port == 0 or not enabled:
        return None, None
    port = config.metrics_port + (local_rank if config.metrics_port > 0 else 0)
    try:
        return start_exporter(latest, run_id, rank, port, config.metrics_addr, config.metrics_port_range)
    except OSError as exc:
        log.warning("sentineld: metrics export off: %s", exc)
        return None, None


def record_metrics_port(run_dir: Path, rank: int, port: int) -> None:
    """Put the bound metrics port into rank 0's run.json (``extra.metrics_port``; other ranks'
    ports are ``metrics_port + local rank`` unless busy). Never raises."""
    if rank != 0:
        return
    try:
        meta = read_run_meta(run_dir)
        write_run_meta(run_dir, dataclasses.replace(meta, extra={**meta.extra, "metrics_port": int(port)}))
    except (OSError, RunDirError) as exc:
        log.warning("sentineld: metrics port not recorded in run.json: %s", exc)


def start_disk_ring(config: AgentConfig, run_dir: Path, rank: int, run_id: str,
                    stream: StreamWriter) -> DiskRingWriter | None:
    """The on-disk ring writer when ``config.disk_ring``; None when off or its directory fails."""
    if not config.disk_ring:
        return None
    try:
        return DiskRingWriter(
            run_dir, rank, config.window,
            run_id=run_id, torch_version=str(torch.__version__),
            on_warning=lambda text: stream.put(AgentNotice(AGENT_WARNING, text).to_json(), urgent=True))
    except OSError as exc:
        log.warning("sentineld: on-disk ring off: %s", exc)
        return None
