"""The replay's counterfactual verdicts, one :class:`replay.counterfactual.Engine` per capture:

- a ``spike`` capture (``capture-...-spike.h5``): the 2x2 spike verdict (:mod:`replay.spike`);
- ``--what-if`` on any single-rank verdict: candidate fixes (:mod:`replay.whatif`) and the
  reproducibility class (:mod:`replay.reproducibility`), a :class:`WhatIf` the verdict is made with.

Both return what they found; :func:`sentineld.contracts.verdict.make_report` makes the verdict.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.capture import CaptureError, open_capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rundir import RunMeta, stream_path
from sentineld.contracts.stream import read_stream
from sentineld.contracts.verdict import Finding, Replayed, WhatIf

from .counterfactual import Engine, Outcome
from .reproducibility import reproducibility
from .spike import explain_spike
from .whatif import what_if

__all__ = ["spike_replay", "what_if_of", "GROWTH_CAUSES", "run_compiled", "run_grad_norms"]


def run_compiled(meta: RunMeta) -> bool:
    """The run was compiled: run.json's ``compiled`` (top level or under ``extra``)."""
    top = getattr(meta, "compiled", None)
    if isinstance(top, bool):
        return top
    extra = meta.extra if isinstance(meta.extra, dict) else {}
    return extra.get("compiled") is True  # as the verdict's check (engine._compiled): "yes", "false" are not


def run_grad_norms(run_dir: Path, rank: int, engine: Engine, before: int) -> list[float]:
    """The run's finite grad norms before step ``before``: its stream (all of it), else the capture's records."""
    vals: list[float] = []
    try:
        objs, _, _ = read_stream(stream_path(run_dir, rank))
        vals = [float(o["grad_norm"]) for o in objs
                if o.get("kind") == "step" and isinstance(o.get("grad_norm"), (int, float))
                and isinstance(o.get("step"), int) and o["step"] < before]
    except (OSError, ValueError):
        vals = []
    if not vals:
        vals = [float(r["grad_norm"]) for s, r in engine.records.items()
                if s < before and isinstance(r.get("grad_norm"), (int, float))]
    return [v for v in vals if math.isfinite(v)]


def spike_replay(cap_path: Path, make: Callable[[], Recipe], step: int | None, environment: Callable[[], Any],
                 *, what: bool = False, compiled: bool = False, repeats: int = 3, t0: float | None = None
                 ) -> tuple[Replayed, WhatIf | None]:
    """The spike verdict of ``step`` (default: the capture's spike step) of a spike capture, and
    with ``what`` its candidate fixes and reproducibility class.

    Raises:
        CaptureError: the step is not a replayable step of the capture.
    """
    t0 = time.perf_counter() if t0 is None else t0
    extras = None
    with open_capture(cap_path) as cap:
        n = cap.first_step if step is None else step
        if n not in cap.steps or n < cap.snapshot_step:
            raise CaptureError(f"step {n} is not a replayable step of {cap_path.name} (snapshot "
                               f"{cap.snapshot_step}, steps {cap.steps[0]}..{cap.steps[-1]})")
        with environment() as in_effect:
            engine = Engine(cap, make)
            engine.state_before(n)
            t1 = time.perf_counter()
            spike = explain_spike(engine, n, flagged=cap.first_step)
            if what:
                extras = _extras(spike.found, engine, n, cap_path, cap.rank, compiled, repeats, spike=True,
                                 recorded_nonfinite=False)
    return replace(spike, rank=cap.rank, capture=str(cap_path), steps_rebuilt=n - cap.snapshot_step,
                   rebuild_s=round(t1 - t0, 4), elapsed_s=round(time.perf_counter() - t0, 4),
                   evidence={"snapshot_step": cap.snapshot_step, "torch_flags": in_effect}), extras


def what_if_of(r: Replayed, cap_path: Path, make: Callable[[], Recipe], environment: Callable[[], Any],
               *, compiled: bool = False, repeats: int = 3) -> WhatIf:
    """The ``what_if`` rows and ``reproducibility`` of a non-finite replay of ``cap_path``."""
    f = r.found
    with open_capture(cap_path) as cap, environment():
        engine = Engine(cap, make)
        # a verdict that found every value finite followed the captured steps (auto mode):
        # the fault the run recorded is at the step it asked about
        start = f.step if f.phase != "none" else r.requested_step
        return _extras(f, engine, start, cap_path, r.rank, compiled, repeats, spike=False,
                       recorded_nonfinite=r.recorded_nonfinite,
                       wi_from=cap.snapshot_step if f.cause_class in GROWTH_CAUSES else None)


#: Causes that grow over steps (the state at the offending step is already broken): their
#: candidates run from the capture's snapshot, the earliest state it holds.
GROWTH_CAUSES = ("lr_too_high", "grad_explosion", "grad_accumulated")


def _extras(found: Finding, engine: Engine, start: int, cap_path: Path, rank: int, compiled: bool, repeats: int,
            spike: bool, recorded_nonfinite: bool, wi_from: int | None = None) -> WhatIf:
    bar = found.evidence.get("spike_bar") if spike else None
    grads = run_grad_norms(cap_path.parent, rank, engine, start if wi_from is None else wi_from)
    wi_start = start if wi_from is None else wi_from
    if spike and found.cause_class == "state" and isinstance(found.evidence.get("earlier_state_step"), int):
        wi_start = found.evidence["earlier_state_step"]  # fix the step that made the spiking state
    rows, summary = what_if(engine, found, wi_start, grads, spike_bar=bar if isinstance(bar, float) else None,
                            spike_step=start)
    if spike and isinstance(bar, float) and math.isfinite(bar):
        def faulty(o: Outcome) -> bool:
            v = o.losses.get(start)
            return v is None or not math.isfinite(v) or v >= bar
        recorded = engine.recorded.get(start)
        recorded_fault = recorded is not None and (not math.isfinite(recorded) or recorded >= bar)
    else:
        def faulty(o: Outcome) -> bool:
            return not o.finite
        recorded_fault = recorded_nonfinite or any(
            not math.isfinite(v) for s, v in engine.recorded.items() if s >= start)
    return WhatIf(rows, summary, reproducibility(engine, start, faulty=faulty, recorded_fault=recorded_fault,
                                                 compiled=compiled, repeats=repeats))
