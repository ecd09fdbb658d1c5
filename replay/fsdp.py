"""An FSDP2 run's snapshot, consolidated into this process from its DCP checkpoint.

A ``fully_shard`` run's captures hold placeholders where its DTensors were; the shards are in
one DCP checkpoint per incident (:mod:`sentineld.contracts.dcpstate`). The replay loads every
rank's shard into whole tensors here (DCP reshards from each shard's global offsets, so any
world size loads), fills the placeholders, and from then on replays the step as a DDP step
(:mod:`sentineld.replay.ddp`): FSDP2's reduce-scatter averages each gradient over the ranks as
DDP's all-reduce does (on gloo: each rank's gradient divided by a power of two, summed, divided
again; the same sum), and every rank's optimizer step on its shard is the whole model's step,
elementwise.

What differs from DDP and is said in the evidence: FSDP does not broadcast buffers, so a model
whose buffers change in training (BatchNorm statistics) has per-rank buffers the replay takes
from rank 0 (the checkpoint keeps one copy of an unsharded tensor).

Consolidated is the default when the unsharded state fits in this host's available memory
(with :data:`HEADROOM` for the replay's own copies); otherwise the error says to re-launch the
replay at the recorded world size (``--world-size N``).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

from sentineld.contracts.capture import Capture
from sentineld.contracts.dcpstate import (
    checkpoint_bytes,
    dcp_errors,
    describe_dcp_error,
    fill_sharded,
    load_consolidated,
    placeholders,
)
from sentineld.contracts.errors import BadInput, SentineldError
from sentineld.contracts.fsdpunits import mixed_units, read_units
from sentineld.contracts.rundir import read_run_meta

from .errors import ReplayError

__all__ = ["HEADROOM", "available_bytes", "consolidated_snapshot"]

#: Multiple of the consolidated state's bytes the replay needs free: the loaded tensors, the
#: recipe's model + optimizer they are loaded into, and a fresh model for a second pass.
HEADROOM = 3.0


def available_bytes() -> int:
    """Host memory available now (``MemAvailable`` on Linux, else physical pages), bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def consolidated_snapshot(cap: Capture, snapshot: dict[str, Any],
                          available: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(snapshot with its sharded leaves whole, evidence)`` for a capture of an FSDP2 run.

    Args:
        cap: the capture the snapshot was read from (names the checkpoint directory).
        snapshot: ``cap.snapshot()``, holding placeholders.
        available: host bytes available (default: :func:`available_bytes`).

    Raises:
        ReplayError: the checkpoint directory is missing or damaged, lacks a placeholder's key,
            or its consolidated state does not fit in host memory (the message says what to do).
    """
    name = cap.sharded_state or ""
    path = cap.path.parent / name
    if not (path / ".metadata").is_file():
        raise ReplayError(f"{cap.path.name} is a sharded (FSDP2) capture whose checkpoint {name} is missing "
                          f"from {cap.path.parent}; copy the whole {name}/ directory next to the captures")
    t0 = time.perf_counter()
    try:
        need = checkpoint_bytes(path)
    except dcp_errors() as exc:  # DCP's reader on a damaged .metadata
        raise ReplayError(damaged_checkpoint(path, ".metadata", exc)) from None
    free = available_bytes() if available is None else available
    if need * HEADROOM > free:
        world = len(list(path.glob("__*_0.distcp"))) or "N"  # one shard file per rank that wrote it
        raise ReplayError(f"the consolidated state of {name} takes {need / 2**20:.1f} MiB (x{HEADROOM:g} to "
                          f"replay), more than the {free / 2**20:.0f} MiB free here; re-launch the replay at "
                          f"the recorded world size: sentineld replay {cap.path.parent} --world-size {world}")
    try:
        values = load_consolidated(path)
        whole = fill_sharded(snapshot, values)
    except KeyError as exc:
        raise ReplayError(f"{path}: {exc.args[0]}; the checkpoint belongs to another capture") from None
    except dcp_errors() as exc:  # DCP on damaged shard files (CheckpointException is no Exception)
        raise ReplayError(damaged_checkpoint(path, "shard files", exc)) from None
    evidence: dict[str, Any] = {
        "state": "consolidated", "checkpoint": str(path), "sharded_tensors": len(placeholders(snapshot)),
        "consolidated_bytes": need, "host_available_bytes": free, "load_s": round(time.perf_counter() - t0, 4),
        "note": ("every rank's shards loaded into whole tensors in this process (DCP, no process group); "
                 "the step replayed as DDP's: FSDP's reduce-scatter averages gradients as the all-reduce "
                 "does. Buffers are rank 0's (FSDP does not broadcast them)"),
    }
    try:
        extra = read_run_meta(cap.path.parent).extra
    except (SentineldError, OSError, ValueError):  # no readable run.json: the engine says so itself
        extra = {}
    try:
        mixed = mixed_units(read_units(extra))
    except BadInput as exc:  # said in the verdict, not silently dropped; the replay itself goes on
        mixed, evidence["units_problem"] = [], str(exc)
    if mixed:
        world = len(list(path.glob("__*_0.distcp"))) or "N"
        evidence["mixed_precision"] = [u.to_json() for u in mixed]
        evidence["relaunch"] = f"sentineld replay {shlex.quote(str(cap.path.parent))} --world-size {world}"
        evidence["note"] += (f"; the run computed its units {[u.module or '<root>' for u in mixed]} in mixed "
                             "precision (MixedPrecisionPolicy), this replay in the parameters' dtype, so its losses "
                             "are not the run's: re-launch it at the recorded world size, which applies the "
                             f"policies: {evidence['relaunch']}")
    return whole, evidence


def damaged_checkpoint(path: Path, part: str, exc: BaseException) -> str:
    """The message for a DCP checkpoint whose ``part`` (".metadata", "shard files") DCP cannot read."""
    return (f"{path}: the DCP checkpoint's {part} cannot be read ({describe_dcp_error(exc)}); a file in it is "
            f"truncated or not the one the run wrote: copy the whole {path.name}/ directory again from the run's "
            "directory (every __<rank>_0.distcp and .metadata), or replay another capture with --capture")


def sharded_dir(cap: Capture) -> Path | None:
    """The capture's DCP checkpoint directory, or None for an unsharded capture."""
    return cap.path.parent / cap.sharded_state if cap.sharded_state else None
