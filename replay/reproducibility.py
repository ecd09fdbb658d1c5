"""The fault's class: software, precision, compiler or transient (issue 25), by re-running the
offending step on the captured state through the counterfactual engine.

In order:

1. the step ``repeats`` times on the same device: losses that differ bit for bit are
   **transient** (non-deterministic kernels, hardware);
2. a fault recorded by the run that the replay of the captured state and RNG does not show:
   **compiler** when the run was compiled (``compiled`` in run.json: only the compiled run fails,
   the replay is eager), else **transient** (hardware, or a source the capture does not hold);
   ``ruled_out`` lists what the capture did pin down (the batch, the RNG states, the rebuilt
   state when its losses matched bit for bit, the thread count and deterministic flags);
3. the step and the captured steps after it in float64 (and float32 for a half-precision run):
   finite there, and not merely diverging more slowly (every loss within 1000x the run's level
   before the fault), is **precision**;
4. otherwise **software** (the code or the configuration: it fails at any precision).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from .counterfactual import Change, Engine, Outcome
from .rebuild import same_loss

__all__ = ["reproducibility", "DIVERGING_FACTOR"]

#: A higher-precision run whose loss ends this many times above the run's level before the fault
#: is diverging, not fixed: its class stays software (an lr too large overflows later in float64).
DIVERGING_FACTOR = 1e3


def _identical(a: Outcome, b: Outcome) -> bool:
    return a.losses.keys() == b.losses.keys() and all(same_loss(a.losses[s], b.losses[s]) for s in a.losses)


def _level(engine: Engine, start: int) -> float:
    before = [abs(v) for s, v in engine.recorded.items() if s < start and math.isfinite(v)]
    return max(before) if before else 1.0


def _half(engine: Engine) -> bool:
    rec = engine.recipe_info()
    return rec.autocast_dtype in (torch.float16, torch.bfloat16) or any(
        p.dtype in (torch.float16, torch.bfloat16) for p in rec.model.parameters())


def reproducibility(engine: Engine, start: int, *, faulty: Callable[[Outcome], bool],
                    recorded_fault: bool, compiled: bool = False, repeats: int = 3) -> dict[str, Any]:
    """Classify the fault at ``start`` (module docstring).

    Args:
        faulty: whether an outcome shows the fault (non-finite; for a spike, the spike).
        recorded_fault: the run itself recorded the fault at ``start`` (or the steps after it).
        compiled: the run was compiled (run.json ``compiled``).
        repeats: runs of the unchanged step (>= 2).

    Returns:
        ``{"class", "repeats", "identical", "reproduced", "ruled_out", "float64_finite",
        "float32_finite" (half-precision runs), "compiled", "why", "wall_s"}``.
    """
    t0 = time.perf_counter()
    follow = len([s for s in engine.steps if s > start])
    runs = [engine.run(Change("repeat"), start, follow) for _ in range(max(2, repeats))]
    identical = all(_identical(runs[0], r) for r in runs[1:])
    reproduced = faulty(runs[0])
    out: dict[str, Any] = {"repeats": len(runs), "identical": identical, "reproduced": reproduced,
                           "compiled": compiled, "float64_finite": None}
    ruled_out = ["the batch (recorded)", "the RNG states (restored at the first forward)",
                 "thread count and deterministic flags (as recorded)"]
    if engine.rebuilt.equal:
        ruled_out.insert(1, "the model and optimizer state (rebuilt bit for bit)")
    if not identical:
        out.update({"class": "transient", "ruled_out": [],
                    "why": f"{len(runs)} runs of step {start} on the same state gave different losses: "
                           "a non-deterministic kernel or the hardware"})
    elif recorded_fault and not reproduced:
        cls = "compiler" if compiled else "transient"
        out.update({"class": cls, "ruled_out": ruled_out,
                    "why": ("the compiled run failed here, the eager replay of the same state does not"
                            if compiled else
                            "the run failed here, the replay of its captured state and RNG does not: the "
                            "hardware or a source the capture does not hold (an input read outside the "
                            "batch, another process, a data race)")})
    else:
        level = _level(engine, start)

        def fixed(o: Outcome) -> bool:
            return not faulty(o) and o.error is None and all(
                math.isfinite(v) and abs(v) <= DIVERGING_FACTOR * level for v in o.losses.values())
        f64 = engine.run(Change("float64", dtype="float64"), start, follow)
        out["float64_finite"] = fixed(f64)
        out["float64_losses"] = {str(s): v for s, v in sorted(f64.losses.items())}
        if f64.error:
            out["float64_error"] = f64.error
        f32_ok = None
        if _half(engine):
            f32 = engine.run(Change("float32", dtype="float32"), start, follow)
            f32_ok = out["float32_finite"] = fixed(f32)
        if f32_ok or out["float64_finite"]:
            which = "float32" if f32_ok else "float64"
            out.update({"class": "precision", "ruled_out": ruled_out,
                        "why": f"the same steps in {which} do not fail: a range or rounding fault of the "
                               "run's precision"})
        else:
            out.update({"class": "software", "ruled_out": ruled_out,
                        "why": "it reproduces from the captured state, in float64 too: the code or the configuration"})
    out["wall_s"] = round(time.perf_counter() - t0, 4)
    return out
