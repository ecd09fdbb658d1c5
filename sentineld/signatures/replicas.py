"""DDP replica consistency: the ranks' replicas of the model hold different parameters.

DDP never compares its replicas after construction; the agent does (``agent/replicas.py``:
position-weighted checksums of every parameter, compared through the job's store on sampled
steps) and writes a ``replica_divergence`` stream line, which the daemon carries on the newest
step record of the rank's window (:attr:`~sentineld.contracts.records.StepRecord.replicas`).
The checksum comparison is exact (a one-element change always changes the sum), so there is no
threshold: one divergence fires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import ReplicaDivergence, StepRecord

from .base import Verdict, make_verdict, trailing

__all__ = ["ReplicaDivergenceConfig", "detect_replica_divergence", "REPLICA_FIX"]

REPLICA_FIX = (
    "Replicas that DDP keeps equal diverged: silent data corruption or a non-deterministic / "
    "rank-dependent update, e.g. a rank-local op on replicated parameters. Check the hardware of "
    "the named ranks (ECC errors: nvidia-smi -q -d ECC) and any code that touches parameters on "
    "one rank only (in-place edits under `if rank == ...`, per-rank RNG in the update); the "
    "replica_divergence captures hold every rank's state at that step.")


@dataclass(frozen=True)
class ReplicaDivergenceConfig:
    """``replica_divergence``: the agent found the DDP replicas' parameters differ.

    Attributes:
        enabled: run this detector. No threshold: the agent's checksums are exact.
    """

    enabled: bool = True


def detect_replica_divergence(records: Sequence[StepRecord], config: ReplicaDivergenceConfig) -> list[Verdict]:
    """Report the latest replica divergence carried by a record of the window.

    Args:
        records: step records, oldest first; those the daemon tagged carry ``replicas``.
        config: on/off.

    Returns:
        One critical verdict at the divergence's step (the optimizer step after which the
        replicas differed), naming the ranks and the first differing parameter; or nothing.
    """
    if not config.enabled:
        return []
    for r in trailing(records):
        d = getattr(r, "replicas", None)
        if not isinstance(d, ReplicaDivergence):
            continue
        ranks = ", ".join(str(x) for x in d.ranks)
        msg = (f"DDP replicas differ after the optimizer step of step {d.step}: rank(s) {ranks} hold "
               f"other parameter values, first in parameter {d.parameter!r}")
        numbers = {"ranks_differing": len(d.ranks), "first_rank": d.ranks[0] if d.ranks else None}
        return [make_verdict("replica_divergence", d.step, msg, numbers, REPLICA_FIX)]
    return []
