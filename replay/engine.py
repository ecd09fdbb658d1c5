"""Replay a run: rebuild the state before the offending step, then localize its first non-finite value.

Method (``debugging-and-diagnosis.txt``, "binary replay"): find the first bad step, restore the
model state and the batch of that step, and re-run it in isolation. The state at step N is rebuilt
from snapshot S by re-executing S..N-1 (``replay.rebuild``); step N then runs instrumented
(``replay.localize``). If the rebuild turns non-finite before N (the agent saw the fault a step
late, e.g. the optimizer broke the parameters one step before the loss showed it), that earlier
step is the offending one. Without ``step``, a trigger step that re-runs finite (only the grad
norm overflowed, say) is followed through the captured steps after it.

Errors: every failure is one of :class:`ReplayError`, ``CaptureError``, ``RunDirError``,
``RecipeError`` or ``UntrustedError``, each with a message saying what to do; the CLI maps them to
exit code 2. An exception raised by the model code while re-executing becomes a ReplayError.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.capture import CaptureError, first_rank_capture, open_capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rundir import RunDir, RunDirError, list_captures, parse_capture_name, read_run_meta
from sentineld.contracts.triggers import NONFINITE, SPIKE
from sentineld.contracts.verdict import CompiledCheck, Replayed, Report, make_report

from .errors import ReplayError
from .localize import localize
from .rebuild import RebuildError, Rebuilt, load_snapshot, rebuild, torch_globals
from .run_recipe import recipe_factory
from .trust import RecipeError, UntrustedError

__all__ = ["ReplayError", "replay_run", "replay_capture", "find_capture"]

log = logging.getLogger("sentineld.replay")


def find_capture(run_dir: Path, step: int | None, rank: int | None = None) -> Path:
    """The capture holding ``step`` (or the earliest incident capture when ``step`` is None); in a
    multi-rank run, the rank that went non-finite first (or ``rank`` when given).

    Raises:
        ReplayError: the run has no capture, or none holds ``step`` (lists the steps that exist).
    """
    caps = list_captures(run_dir)
    if not caps:
        raise ReplayError(f"{run_dir}: no capture-*.h5 in this run; a capture is written when the "
                          "agent sees a non-finite loss, grad norm or learning rate, or on a crash")
    if rank is not None:
        caps = [c for c in caps if c[0] == rank]
        if not caps:
            raise ReplayError(f"{run_dir}: no capture of rank {rank}; ranks with captures: "
                              f"{sorted({c[0] for c in list_captures(run_dir)})}")
    if step is None:
        incidents = [c for c in caps if c[2] == NONFINITE] or caps
        first = [c for c in incidents if c[1] == incidents[0][1]]
        return first_rank_capture(first)
    spans = []
    for _rank, _n, _trigger, path in caps:
        try:
            with open_capture(path) as cap:
                steps = cap.steps
        except (CaptureError, OSError) as exc:
            log.warning("skipping %s", exc)
            continue
        if step in steps:
            return path
        if steps:
            spans.append(f"{steps[0]}..{steps[-1]} ({path.name})")
    raise ReplayError(f"step {step} is in no capture of {run_dir.name}; captured steps: "
                      f"{', '.join(spans) or 'none readable'}")


def replay_run(run_dir: str | Path, step: int | None = None, *, recipe: str | None = None,
               trust: bool = False, capture: str | Path | None = None, rank: int | None = None,
               what_if: bool = False, repeats: int = 3) -> Report:
    """Replay a run's offending step and return the verdict.

    Args:
        run_dir: the run directory.
        step: the step to explain; default the capture's first non-finite step.
        recipe: ``module:function`` overriding the one in run.json.
        trust: import the recipe without ownership checks (logged as a warning).
        capture: a specific capture file (default: the one holding ``step``).
        what_if: also check candidate fixes and classify the fault (``what_if`` and
            ``reproducibility`` in the verdict; :mod:`replay.cf_replay`). A ``spike`` capture
            always gets the spike verdict (:mod:`replay.spike`).
        repeats: runs of the unchanged step for the reproducibility class.

    Returns:
        The :class:`Report`; ``reproduced`` says whether every re-executed loss equalled the
        recorded one bit for bit.

    Raises:
        ReplayError, CaptureError, RunDirError, RecipeError, UntrustedError: bad input, each with a
            message saying what to do (never another exception type).
    """
    try:
        return _replay(Path(run_dir), step, recipe, trust, capture, rank, what_if, repeats)
    except (ReplayError, CaptureError, RunDirError, RecipeError, UntrustedError):
        raise
    except RebuildError as exc:
        raise ReplayError(f"the model cannot be rebuilt: {exc}") from None
    except (Exception, SystemExit) as exc:  # the user's model code, or h5py on a damaged file
        raise ReplayError(f"re-executing the run's steps failed: {type(exc).__name__}: {exc}") from exc


def _is_spike(cap_path: Path) -> bool:
    parsed = parse_capture_name(cap_path.name)
    if parsed is not None:
        return parsed[2] == SPIKE
    with open_capture(cap_path) as cap:
        return cap.trigger == SPIKE


def _replay(run_dir: Path, step: int | None, spec: str | None, trust: bool,
            capture: str | Path | None, rank: int | None = None, what_if: bool = False,
            repeats: int = 3) -> Report:
    t0 = time.perf_counter()
    meta = read_run_meta(run_dir)
    ranks: dict[int, Path] = {}
    missing: list[int] = []
    if meta.world_size > 1 and rank is None and (spec or meta.recipe or meta.extra.get("live_recipe")):
        from .ddp import missing_ranks_error, rank_captures  # noqa: PLC0415

        # A DDP step needs every rank's batch; given one capture (the daemon), use its rank
        # alone when the others are missing (a partial verdict).
        ranks, missing, n = rank_captures(run_dir, meta.world_size, step, Path(capture) if capture else None)
        if missing and capture is None:
            raise missing_ranks_error(run_dir, meta.world_size, n, ranks, missing)
        ranks = {} if missing else ranks
    cap_path = Path(capture) if capture else ranks[0] if ranks else find_capture(run_dir, step, rank)
    named_by = [p for p in (run_dir / RunDir.RUN_JSON, cap_path) if p.exists()]
    from .live_recipe import recipe_of  # noqa: PLC0415

    if not spec and recipe_of(meta) is None:  # a run with neither recipe nor loss_fn: forward-only
        from .forward_replay import replay_forward_only  # noqa: PLC0415

        return make_report(replay_forward_only(meta, cap_path, trust, named_by), meta.run_id)
    flags = meta.extra.get("torch_flags") if isinstance(meta.extra, dict) else None
    env = lambda: torch_globals(meta.num_threads, flags if isinstance(flags, dict) else None)  # noqa: E731
    if ranks:
        from .ddp import replay_ddp  # noqa: PLC0415

        named_by += [p for r, p in sorted(ranks.items()) if r]
        replayed = replay_ddp(ranks, recipe_factory(meta, spec, trust, named_by), step, env, t0=t0)
        # A sharded run's shards were loaded whole here (replay/fsdp.py).
        return make_report(replayed, meta.run_id, compiled=_compiled(replayed, meta.extra),
                           replayed_as="consolidated" if "fsdp" in replayed.evidence else None)
    if meta.world_size > 1 and _is_spike(cap_path):
        raise ReplayError(f"{cap_path.name}: a loss-spike verdict of a {meta.world_size}-rank run is not "
                          "replayed yet (each rank's step used all ranks' gradients); replay a "
                          "single-process run's spike, or the non-finite captures of this run")
    if not missing and (what_if or _is_spike(cap_path)):
        from .cf_replay import run_compiled, spike_replay, what_if_of  # noqa: PLC0415

        if _is_spike(cap_path):  # a compiled run's spike says it was replayed eagerly, as a NaN's verdict does
            make = recipe_factory(meta, spec, trust, named_by)
            spiked, extras = spike_replay(cap_path, make, step, env, what=what_if, compiled=run_compiled(meta),
                                          repeats=repeats, t0=t0)
            return make_report(spiked, meta.run_id, what_if=extras, compiled=_compiled(spiked, meta.extra))
        replayed = replay_capture(cap_path, lambda: recipe_factory(meta, spec, trust, named_by), step, env, t0=t0)
        wi = what_if_of(replayed, cap_path, recipe_factory(meta, spec, trust, named_by), env,
                        compiled=run_compiled(meta), repeats=repeats)
        elapsed = round(replayed.elapsed_s + wi.summary["total_s"] + wi.reproducibility.get("wall_s", 0.0), 4)
        return make_report(replayed, meta.run_id, what_if=wi, elapsed_s=elapsed,
                           compiled=_compiled(replayed, meta.extra))
    try:
        replayed = replay_capture(cap_path, lambda: recipe_factory(meta, spec, trust, named_by), step, env, t0=t0)
    except ReplayError as exc:
        from sentineld.contracts.verdict_file import verdict_path  # noqa: PLC0415

        own = verdict_path(cap_path)
        if spec or meta.recipe or "recorded model, optimizer and loss_fn" not in str(exc):
            raise
        raise ReplayError(f"{exc}; or pass --recipe module:function"
                          + (f"; the training process's own verdict is in {own}" if own.exists() else "")) from None
    if missing:
        from .ddp import partial_evidence  # noqa: PLC0415

        replayed = replace(replayed, evidence={**replayed.evidence,
                                               **partial_evidence(replayed.rank, meta.world_size, missing)})

    def rerun(backend: str | None) -> dict[str, Any]:
        from .compiled import compiled_rerun  # noqa: PLC0415

        # The incident's step (requested), not the last one auto mode followed to finding nothing.
        return compiled_rerun(cap_path, run_dir, spec, trust, replayed.requested_step, backend)

    return make_report(replayed, meta.run_id, compiled=_compiled(replayed, meta.extra, rerun))


def _compiled(r: Replayed, extra: Any, rerun: Callable[[str | None], dict[str, Any]] | None = None
              ) -> CompiledCheck | None:
    """A compiled run's verdict says it was replayed eagerly (replay/compiled.py); a fault eager
    did not make is re-run compiled (``rerun``, single-capture replays). None: an eager run."""
    if isinstance(extra, dict) and extra.get("compiled") is True:
        from .compiled import check_compiled  # noqa: PLC0415

        return check_compiled(r, extra, rerun)
    return None


def replay_capture(cap_path: Path, factory: Callable[[], Callable[[], Recipe]], step: int | None,
                   environment: Callable[[], Any], *, t0: float | None = None) -> Replayed:
    """Replay ``step`` of one capture with recipes from ``factory()()`` inside ``environment()``.

    The daemon-side replay passes the run's recipe and :func:`torch_globals`; the training
    process's own localization (:mod:`sentineld.agent.localize_live`) passes copies of its live
    model and an environment that leaves the training's RNG and settings alone.

    Args:
        factory: called once after the capture opened (so a bad capture is reported before any
            user code runs); returns ``make``, which builds a fresh :class:`Recipe` per call.
        step: the step to explain, or None for the capture's first step (auto mode).
        environment: a context manager factory yielding the process settings in effect (evidence).

    Returns:
        What it found (:class:`Replayed`; :func:`~sentineld.contracts.verdict.make_report` makes
        the verdict of it).

    Raises:
        CaptureError: the step is not in the capture or precedes its snapshot.
    """
    t0 = time.perf_counter() if t0 is None else t0
    with open_capture(cap_path) as cap:
        steps = cap.steps
        target = cap.first_step if step is None else step
        if target not in steps:
            span = f"{steps[0]}..{steps[-1]}" if steps else "none"
            raise CaptureError(f"step {target} is not in capture {cap_path.name}; it holds steps {span} "
                               f"(snapshot at {cap.snapshot_step})")
        if target < cap.snapshot_step:
            raise CaptureError(f"step {target} precedes the capture's snapshot (step {cap.snapshot_step}); "
                               f"replayable steps: {cap.snapshot_step}..{steps[-1]}")
        records = {int(r["step"]): r for r in cap.records() if isinstance(r, dict) and "step" in r}
        losses = {s: float(r["loss"]) for s, r in records.items() if isinstance(r.get("loss"), (int, float))}
        make = factory()
        rec = make()
        S = cap.snapshot_step

        def load(s: int) -> tuple[Any, Any]:
            st = cap.step(s)
            return st.batch, st.rng

        with environment() as in_effect:
            recast = load_snapshot(rec, cap.snapshot())
            result = rebuild(rec, range(S, target), load, losses)
            offending = target
            if result.broke is not None and result.broke < target:
                offending = result.broke
                rec = make()
                load_snapshot(rec, cap.snapshot())
                result = rebuild(rec, range(S, offending), load, losses, result=Rebuilt())
            t1 = time.perf_counter()
            while True:
                batch, rng = load(offending)
                found = localize(rec, offending, batch, rng, records.get(offending))
                result.compare(offending, found.evidence["replayed_loss"], losses.get(offending))
                if found.phase != "none" or step is not None or offending >= steps[-1]:
                    break
                offending += 1  # auto mode: follow the captured steps to the first real fault
            t2 = time.perf_counter()
    rec_loss = losses.get(offending)
    autocast = str(rec.autocast_dtype).removeprefix("torch.") if rec.autocast_dtype else None
    ev = {"rebuilt_losses": {str(s): v for s, v in sorted(result.losses.items())}, "snapshot_step": S,
          "precision": {"param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in rec.model.parameters()}),
                        "autocast_dtype": autocast, "recast_from_snapshot": recast[:8]},
          "torch_flags": in_effect}
    if not rec.zero_grad and S > 0:
        ev["warning"] = ("the loop never zeroes gradients and the snapshot holds none: gradients "
                         "carried into step S are missing, so the rebuild cannot be exact")
    return Replayed(found, requested_step=target, reproduced=result.equal, rank=cap.rank, capture=str(cap_path),
                    max_loss_deviation=result.max_deviation, steps_rebuilt=offending - S,
                    recorded_nonfinite=bool(found.evidence.get("recorded_nonfinite")) or (
                        rec_loss is not None and not math.isfinite(rec_loss)),
                    rebuild_s=round(t1 - t0, 4), localize_s=round(t2 - t1, 4),
                    elapsed_s=round(time.perf_counter() - t0, 4), evidence=ev)
