"""Replay of a data-parallel (DDP) run from every rank's capture, in one process.

Each rank's capture holds the same model and optimizer state (DDP keeps them equal) but its own
batches and RNG states, so the state at the offending step N is rebuilt from all of them: the
snapshot S is the latest snapshot step among the ranks' captures (rank 0's when it has it, since
its buffers are the ones DDP broadcasts), every capture must hold the batches of S..N, and each
step S..N-1 re-runs as DDP ran it (:mod:`sentineld.replay.ddp_step`). Every rank's rebuilt loss is
compared with that rank's recorded loss: bit for bit for two ranks, within
:func:`~sentineld.replay.ddp_step.loss_tolerance` beyond (reported as ``loss_tolerance``). Step N
then runs under the tracer (:func:`sentineld.replay.localize.localize`) with the ranks' batches
as micro-batches, and the micro-batch of the first birth names the rank it was born on.

Errors: a rank's capture missing for the step is a :class:`~sentineld.replay.engine.ReplayError`
naming the ranks (exit 2); ``--rank R`` replays one rank's capture alone instead. A replay given
one capture (``--capture``, as the daemon starts it) whose peers are missing (a multi-host job
whose other hosts keep their own captures) replays that rank alone and says so (a partial verdict,
``evidence.ddp.partial``).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.capture import Capture, CaptureError, open_capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rundir import list_captures
from sentineld.contracts.triggers import NONFINITE
from sentineld.contracts.verdict import Finding, Replayed

from .ddp_step import DdpStep, ddp_recipe, loss_tolerance
from .errors import ReplayError
from .localize import localize
from .rebuild import load_snapshot, run_step, same_loss, state_nonfinite

__all__ = ["DdpReplayError", "rank_captures", "missing_ranks_error", "partial_evidence", "replay_ddp"]


class DdpReplayError(ReplayError):
    """A DDP run cannot be replayed from its captures (a rank's capture missing or too short)."""


def rank_captures(run_dir: Path, world: int, step: int | None, capture: Path | None = None
                  ) -> tuple[dict[int, Path], list[int], int]:
    """Every rank's capture of the incident step, and the ranks that have none.

    The step is ``step``, else ``capture``'s incident step (the daemon names the capture it saw),
    else the run's earliest non-finite capture step. A capture is named by the step its incident
    opened at; a rank without one of that name gives any capture of its that holds the step
    (from its snapshot on). ``capture`` is its rank's capture.

    Returns:
        ``({rank: path}, missing ranks of range(world), the step)``.

    Raises:
        DdpReplayError: the run has no capture.
        CaptureError: ``capture`` is damaged.
    """
    caps = list_captures(run_dir)
    found: dict[int, Path] = {}
    target = step
    if capture is not None:
        with open_capture(capture) as cap:
            found[cap.rank] = Path(capture)
            target = cap.first_step if step is None else step
    elif not caps:
        raise DdpReplayError(f"{run_dir}: no capture-*.h5 in this run; a capture is written when the "
                             "agent sees a non-finite loss, grad norm or learning rate, or on a crash")
    if target is None:
        incidents = [c for c in caps if c[2] == NONFINITE] or caps
        target = incidents[0][1]
        for r, n, _t, path in incidents:
            if n == target:
                found.setdefault(r, path)
    # Any other capture holding the step will do (a rank that opened its incident a step later).
    for r, _n, _t, path in caps:
        if r in found or r >= world:
            continue
        with contextlib.suppress(CaptureError, OSError), open_capture(path) as cap:
            if target in cap.steps and cap.snapshot_step <= target:
                found[r] = path
    if not found and step is not None:  # no rank holds it: a step outside the captures, not files left behind
        raise DdpReplayError(_no_capture_holds(run_dir, step, caps))
    return {r: found[r] for r in sorted(found)}, [r for r in range(world) if r not in found], target


def _no_capture_holds(run_dir: Path, step: int, caps: list[tuple[int, int, str, Path]]) -> str:
    """The message for ``--step`` that no capture of the run holds (names the steps they do hold)."""
    spans: set[tuple[int, int]] = set()
    for _r, _n, _t, path in caps:
        with contextlib.suppress(CaptureError, OSError), open_capture(path) as cap:
            if cap.steps:
                spans.add((max(cap.snapshot_step, int(cap.steps[0])), int(cap.steps[-1])))
    held = ", ".join(f"{a}..{b}" for a, b in sorted(spans)) or "none readable"
    return (f"{run_dir.name}: no capture holds step {step} (a capture replays the steps from its snapshot to its "
            f"last recorded step; this run's captures hold steps {held}); pass --step within those, or omit "
            "--step for the first non-finite step")


def missing_ranks_error(run_dir: Path, world: int, step: int, found: dict[int, Path],
                        missing: list[int]) -> DdpReplayError:
    """The error for a DDP step some of whose ranks' captures are missing (names them, says what to do)."""
    return DdpReplayError(
        f"{run_dir.name}: the captures of rank(s) {missing} for step {step} are missing (found rank(s) "
        f"{sorted(found) or 'none'} of {world}); a DDP step is rebuilt from every rank's batch. "
        f"Copy capture-rank{missing[0]}-*.h5 from the host that ran rank {missing[0]} into "
        f"{run_dir}, or pass --rank {min(found) if found else 0} to replay one rank alone "
        "(its rebuilt losses deviate once the snapshot is older than the step)")


def partial_evidence(rank: int, world: int, missing: list[int]) -> dict[str, Any]:
    """The evidence of one rank's replay of a DDP run: which rank it used and which it lacked."""
    return {"ddp": {
        "world_size": world, "partial": True, "ranks_used": [rank], "missing_ranks": missing,
        "note": (f"the captures of rank(s) {missing} are missing: rank {rank}'s batches were "
                 "re-executed alone, without the other ranks' gradients, so once the snapshot is older "
                 "than the step the rebuilt losses deviate")}}


@dataclass
class _Ranks:
    """The ranks' open captures and what the rebuild takes from them."""

    caps: dict[int, Capture]
    snapshot_rank: int
    S: int
    last: int
    losses: dict[int, dict[int, float]]
    records: dict[int, dict[int, dict[str, Any]]]

    def load(self, s: int) -> tuple[list[Any], list[Any]]:
        """The ranks' batches and RNG states of step ``s``, rank order."""
        steps = [self.caps[r].step(s) for r in sorted(self.caps)]
        return [st.batch for st in steps], [st.rng for st in steps]


def _ranks(caps: dict[int, Capture], target: int) -> _Ranks:
    snaps = {r: c.snapshot_step for r, c in caps.items()}
    S = max(snaps.values())
    if S > target:
        raise DdpReplayError(f"step {target} precedes the ranks' snapshots {snaps}; replay a later step")
    snap_rank = 0 if snaps.get(0) == S else min(r for r, s in snaps.items() if s == S)
    last = min(c.steps[-1] if c.steps else -1 for c in caps.values())
    for r, c in caps.items():
        held = set(c.steps)
        gap = [s for s in range(S, target + 1) if s not in held]
        if gap:
            raise DdpReplayError(f"capture {c.path.name} of rank {r} lacks steps {gap[:8]} of {S}..{target}; "
                                 "every rank's capture must hold the steps from the snapshot on")
    records = {r: {int(x["step"]): x for x in c.records() if isinstance(x, dict) and "step" in x}
               for r, c in caps.items()}
    losses = {r: {s: float(x["loss"]) for s, x in recs.items() if isinstance(x.get("loss"), (int, float))}
              for r, recs in records.items()}
    return _Ranks(caps, snap_rank, S, last, losses, records)


@dataclass
class _Compare:
    """Every rank's rebuilt loss against its recorded one."""

    world: int
    rebuilt: dict[int, dict[int, float]]
    equal: bool = True
    within: bool = True
    max_deviation: float = 0.0
    tolerance: float = 0.0

    def add(self, step: int, losses: list[float], recorded: dict[int, dict[int, float]]) -> None:
        for r, loss in enumerate(losses):
            self.rebuilt.setdefault(r, {})[step] = loss
            rec = recorded.get(r, {}).get(step)
            if rec is None or same_loss(loss, rec):
                continue
            self.equal = False
            dev = abs(loss - rec) if math.isfinite(loss) and math.isfinite(rec) else math.inf
            tol = loss_tolerance(self.world, rec)
            self.tolerance = max(self.tolerance, tol)
            self.max_deviation = max(self.max_deviation, dev)
            self.within = self.within and dev <= tol


def _rebuild(ddp: Recipe, state: DdpStep, ranks: _Ranks, steps: range, cmp: _Compare) -> int | None:
    """Re-execute ``steps``; return the first step that left a non-finite loss or state."""
    for s in steps:
        batches, rngs = ranks.load(s)
        state.begin(rngs)
        run_step(ddp, batches, None)
        cmp.add(s, state.losses, ranks.losses)
        if any(not math.isfinite(x) for x in state.losses) or state_nonfinite(ddp):
            return s
    return None


_FIELD = re.compile(r"^batch\[(\d+)\](.*)$")


def _attribute(found: Finding, world: int, state: DdpStep) -> tuple[Finding, list[int]]:
    """``(the finding in the run's terms, the ranks where the first non-finite value was born)``.

    The replay runs the W ranks' batches as W micro-batches of one step (:mod:`.ddp_step`), so
    the localizer names micro-batches: ``batch[r]...`` fields, ``micro_batch`` r and the W
    ``micro_losses``. A DDP step has no gradient accumulation (the text verdict said
    "micro-batch: 2 of 2 (gradient accumulation)" and "input batch, batch[1][0]" for a fault
    on rank 1 of a plain 2-rank run): fields are renamed relative to the rank's own batch (with
    their ``rank``), the micro-batch keys become ``rank_losses`` (each rank's loss of the step),
    and ``where`` names the rank's field. A new Finding; the localizer's is not changed.
    """
    ev = {k: v for k, v in found.evidence.items() if k not in ("micro_batch", "micro_losses")}
    if "micro_losses" in found.evidence:
        ev["rank_losses"] = found.evidence["micro_losses"]
    if found.phase == "data":
        ranks, fields = [], []
        for f in found.evidence.get("fields", []):
            m = _FIELD.match(str(f.get("field", "")))
            if m:
                ranks.append(int(m.group(1)))
                f = {**f, "rank": int(m.group(1)), "field": "batch" + m.group(2)}
            fields.append(f)
        where = found.where
        if fields:
            ev["fields"], ev["field"] = fields, fields[0]["field"]
            rank = f" on rank {fields[0]['rank']}" if "rank" in fields[0] else ""
            where = f"input batch, {fields[0]['field']}{rank}"
        return replace(found, evidence=ev, where=where), sorted(set(ranks))
    if found.phase in ("forward", "backward"):
        micro = found.evidence.get("micro_batch")
        if isinstance(micro, int):
            return replace(found, evidence=ev), [micro % world]
        bad = [r for r, x in enumerate(state.losses) if not math.isfinite(x)]
        return replace(found, evidence=ev), bad or list(range(world))
    if found.phase == "optimizer":
        return replace(found, evidence=ev), list(range(world))  # every rank: the same averaged gradients
    return replace(found, evidence=ev), []


def replay_ddp(paths: dict[int, Path], make: Callable[[], Recipe], step: int | None,
               environment: Callable[[], Any], *, t0: float | None = None) -> Replayed:
    """Replay a DDP run's step from every rank's capture (``paths``: rank -> capture).

    Args:
        make: builds a fresh :class:`Recipe` (the run's, one rank's model).
        step: the step to explain, or None for the captures' incident step (auto mode: a step
            that re-runs finite is followed through the captured steps after it).
        environment: context manager factory yielding the process settings in effect.

    Returns:
        The verdict; ``rank``/``ranks`` name where the first non-finite value was born,
        ``reproduced`` is True when every rank's rebuilt loss equals its recorded one (within
        ``loss_tolerance``, 0 for two ranks).

    Raises:
        DdpReplayError: the captures do not cover the snapshot..step span of every rank.
        CaptureError: a capture is damaged.
    """
    t0 = time.perf_counter() if t0 is None else t0
    world = len(paths)
    with contextlib.ExitStack() as stack:
        caps = {r: stack.enter_context(open_capture(p)) for r, p in sorted(paths.items())}
        target = min(c.first_step for c in caps.values()) if step is None else step
        ranks = _ranks(caps, target)
        snapshot = caps[ranks.snapshot_rank].snapshot()
        fsdp = None
        if caps[ranks.snapshot_rank].sharded_state:  # FSDP2: the shards, consolidated (replay/fsdp.py)
            from .fsdp import consolidated_snapshot  # noqa: PLC0415

            snapshot, fsdp = consolidated_snapshot(caps[ranks.snapshot_rank], snapshot)
        with environment() as in_effect:
            found, born, cmp, offending, t1 = _run(make, world, ranks, snapshot, target, step is None)
        t2 = time.perf_counter()
    return _finish(found, born, target, paths, ranks, cmp, offending, in_effect,
                   times=(round(t1 - t0, 4), round(t2 - t1, 4), round(time.perf_counter() - t0, 4)), fsdp=fsdp)


def _run(make: Callable[[], Recipe], world: int, ranks: _Ranks, snapshot: dict[str, Any], target: int,
         auto: bool) -> tuple[Finding, list[int], _Compare, int, float]:
    """Rebuild S..target-1 (or up to an earlier break), then localize, following on in auto mode."""
    rec = make()
    if rec.accumulation_steps != 1:
        raise DdpReplayError("replaying a DDP run whose recipe accumulates micro-batches is not supported "
                             "yet; replay one rank's capture with --rank R")
    with ddp_recipe(rec, world) as (ddp, state):
        load_snapshot(rec, snapshot)
        cmp = _Compare(world, {})
        broke = _rebuild(ddp, state, ranks, range(ranks.S, target), cmp)
    offending = target
    if broke is not None and broke < target:
        offending, rec = broke, make()
        with ddp_recipe(rec, world) as (ddp, state):
            load_snapshot(rec, snapshot)
            cmp = _Compare(world, {})
            _rebuild(ddp, state, ranks, range(ranks.S, offending), cmp)
    t1 = time.perf_counter()
    with ddp_recipe(rec, world) as (ddp, state):
        while True:
            batches, rngs = ranks.load(offending)
            state.begin(rngs)
            found = localize(ddp, offending, batches, None, ranks.records.get(0, {}).get(offending))
            cmp.add(offending, state.losses, ranks.losses)
            found, born = _attribute(found, world, state)
            if found.phase != "none" or not auto or offending >= ranks.last:
                break
            offending += 1
    return found, born, cmp, offending, t1


def _finish(found: Finding, born: list[int], target: int, paths: dict[int, Path], ranks: _Ranks, cmp: _Compare,
            offending: int, in_effect: Any, times: tuple[float, float, float],
            fsdp: dict[str, Any] | None = None) -> Replayed:
    """What the DDP replay found, with the rebuild's evidence (``times``: rebuild, localize, elapsed s;
    ``fsdp``: how an FSDP2 run's shards were consolidated, replay/fsdp.py), built whole here: a
    :class:`Replayed` is never changed after."""
    rank = born[0] if born else 0
    tolerance = 0.0 if cmp.equal else cmp.tolerance
    recorded = {r: ranks.losses.get(r, {}).get(offending) for r in sorted(paths)}
    ev: dict[str, Any] = {"rebuilt_losses": {str(s): v for s, v in sorted(cmp.rebuilt.get(rank, {}).items())},
                          "snapshot_step": ranks.S, "torch_flags": in_effect}
    ev["ddp"] = {
        "world_size": len(paths), "ranks_used": sorted(paths), "born_on_ranks": born,
        "snapshot_steps": {str(r): c.snapshot_step for r, c in ranks.caps.items()},
        "snapshot_from_rank": ranks.snapshot_rank,
        "captures": {str(r): str(p) for r, p in sorted(paths.items())},
        "recorded_losses": {str(r): x for r, x in recorded.items()},
        "rebuilt_losses": {str(r): {str(s): v for s, v in sorted(d.items())} for r, d in sorted(cmp.rebuilt.items())},
        "reduction": ("per rank grad * (1/W), summed in rank order (DDP's bucketed all-reduce)" if fsdp is None else
                      "per rank grad * (1/W), summed in rank order (FSDP2's reduce-scatter average, each shard's sum)"),
        "bitwise": cmp.equal, "loss_tolerance": tolerance,
    }
    if fsdp is not None:
        ev["fsdp"] = fsdp
    if ranks.snapshot_rank != 0:
        ev["ddp"]["note"] = (f"snapshot taken from rank {ranks.snapshot_rank}: its buffers (e.g. BatchNorm "
                             "running stats) are its own, not the rank-0 buffers DDP broadcasts")
    return Replayed(found, requested_step=target, reproduced=cmp.equal or cmp.within, rank=rank,
                    capture=str(paths[rank]), max_loss_deviation=cmp.max_deviation, steps_rebuilt=offending - ranks.S,
                    recorded_nonfinite=bool(found.evidence.get("recorded_nonfinite")) or any(
                        x is not None and not math.isfinite(x) for x in recorded.values()),
                    rebuild_s=times[0], localize_s=times[1], elapsed_s=times[2], ranks=born,
                    loss_tolerance=tolerance, evidence=ev)
