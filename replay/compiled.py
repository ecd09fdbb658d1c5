"""What a verdict means for a ``torch.compile``'d run: the replay ran the model eagerly.

The agent attaches to the compiled module (its hooks run outside the compiled graph, so no graph
break is added; per-layer probes are off for a compiled model, see :mod:`sentineld.agent.watch`),
captures at the step boundary (state dicts of the module inside the wrapper), and the replay's
recipe builds the plain, eager model: the rebuild and the localization are eager, with the same
dispatch tracing as for any run. So the verdict says so:

- ``compiled``: true (from run.json ``extra.compiled``; ``extra.compile_backend`` names the backend).
- ``eager_reproduced``: the eager replay made a non-finite value at the run's non-finite step,
  with every rebuilt loss before it within :data:`REL_TOLERANCE` of the recorded (compiled) one.
  A compiler's fused kernels reorder float sums, so eager and compiled losses may differ in the
  last bits; ``reproduced`` for a compiled run accepts that tolerance and says it used it
  (``loss_tolerance``), as the DDP replay does for gloo's ring order.
- When eager does not make the fault, the fault is the compiler's (or a transient): the
  evidence says so, and names what a user runs next (the accuracy minifier on the captured
  step, ``TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from sentineld.contracts.capture import CaptureError, open_capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import CompiledCheck, Replayed

from .rebuild import load_snapshot, rebuild, run_step, state_nonfinite

__all__ = ["REL_TOLERANCE", "check_compiled", "compiled_rerun"]

#: Relative loss deviation accepted between the eager replay and the compiled run (1e-4: a few
#: float32 ulps per fused reduction, grown over a few steps of Adam; the DDP replay's bound).
REL_TOLERANCE = 1e-4


def _recorded(capture: str) -> dict[int, float]:
    try:
        with open_capture(capture) as cap:
            recs = cap.records()
    except (CaptureError, OSError):
        return {}
    return {int(r["step"]): float(r["loss"]) for r in recs
            if isinstance(r, dict) and "step" in r and isinstance(r.get("loss"), (int, float))}


def _as_float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def check_compiled(r: Replayed, extra: Mapping[str, Any],
                   rerun: Callable[[str | None], dict[str, Any]] | None = None) -> CompiledCheck:
    """What the eager replay of a compiled run showed: the verdict's ``eager_reproduced`` and
    ``evidence["compiled"]``, and the tolerance it was reproduced under (module docstring).

    Args:
        r: the eager replay's result (its ``evidence`` holding ``rebuilt_losses``, and ``ddp``
            for a data-parallel replay, which compared every rank with its own tolerance).
        extra: run.json's ``extra`` (``compile_backend``).
        rerun: ``backend -> result`` of :func:`compiled_rerun` for this capture's step, called
            only when eager did not reproduce (None: not re-run, e.g. a DDP replay).
    """
    evidence = {**r.found.evidence, **r.evidence}
    ddp = "ddp" in evidence
    rebuilt = {int(s): _as_float(v) for s, v in dict(evidence.get("rebuilt_losses") or {}).items()}
    recorded = _recorded(r.capture) if not ddp else {}
    finite = [abs(v) for v in list(rebuilt.values()) + list(recorded.values()) if math.isfinite(v)]
    tol = max(1e-6, REL_TOLERANCE * max(finite, default=1.0))
    worst, within = 0.0, True
    for s, got in sorted(rebuilt.items()):
        want = recorded.get(s)
        if want is None:
            continue
        if not math.isfinite(got) and not math.isfinite(want):
            continue  # both non-finite: the same fault (NaN or Inf, eager and fused kernels may differ)
        dev = abs(got - want) if math.isfinite(got) and math.isfinite(want) else math.inf
        worst = max(worst, dev)
        within = within and dev <= tol
    if ddp:  # the DDP replay compared every rank with its own tolerance already
        within = r.reproduced
    # The capture was written because the compiled run went non-finite at its incident step;
    # a verdict with a phase is the eager replay making a non-finite value there too.
    eager_reproduced = bool(r.found.phase != "none" and within)
    ev: dict[str, Any] = {"backend": extra.get("compile_backend"), "replayed": "eager",
                          "tolerance": tol, "max_deviation": worst, "eager_reproduced": eager_reproduced}
    if not eager_reproduced:
        ev["note"] = ("the eager replay does not make the run's non-finite value: the compiled graph (or a "
                      "transient) does. Re-run the captured step compiled under the accuracy minifier: "
                      "TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4, with the captured batch")
        if rerun is not None:
            ev["compiled_rerun"] = rerun(extra.get("compile_backend"))
    accepted = within and not r.reproduced and bool(recorded)
    return CompiledCheck(eager_reproduced, ev, tolerance=tol if accepted else None,
                         max_loss_deviation=worst if accepted else 0.0)


def compiled_rerun(cap_path: Path, make: Callable[[], Recipe], step: int, environment: Callable[[], Any],
                   backend: str | None) -> dict[str, Any]:
    """Re-run ``step`` of the capture compiled (best effort), for a fault eager did not make.

    The state before ``step`` is rebuilt eagerly from the snapshot and the captured batches; then
    the recipe's model is compiled with the run's backend and the captured step runs with its
    real batch and RNG state, under dynamo's accuracy minifier (``repro_after="aot"``,
    ``repro_level=4``: each AOT graph is checked against an fp64 eager run; a graph that fails
    is written as a repro script) into ``<capture>.minifier/`` next to the capture.

    Returns:
        ``{"backend", "loss", "nonfinite", "minifier_dir", "repro_files"}``, or with ``"error"``
        when the re-run itself failed (never raises).
    """
    out: dict[str, Any] = {"backend": backend or "inductor"}
    outdir = cap_path.with_suffix(".minifier")
    try:
        import torch  # noqa: PLC0415
        import torch._dynamo.config as dynamo_config  # noqa: PLC0415

        with open_capture(cap_path) as cap, environment():
            recs = {int(r["step"]): r for r in cap.records() if isinstance(r, dict) and "step" in r}
            losses = {s: float(r["loss"]) for s, r in recs.items() if isinstance(r.get("loss"), (int, float))}
            rec = make()
            load_snapshot(rec, cap.snapshot())

            def load(s: int) -> tuple[Any, Any]:
                st = cap.step(s)
                return st.batch, st.rng

            rebuild(rec, range(cap.snapshot_step, step), load, losses)
            batch, rng = load(step)
            outdir.mkdir(mode=0o700, exist_ok=True)
            torch._dynamo.reset()
            with dynamo_config.patch(repro_after="aot", repro_level=4, debug_dir_root=str(outdir)):
                module: Any = torch.compile(rec.model, backend=out["backend"])  # an OptimizedModule
                compiled = replace(rec, model=module)
                loss = run_step(compiled, batch, rng)
            torch._dynamo.reset()
        out.update(loss=loss, nonfinite=not math.isfinite(loss) or state_nonfinite(rec))
    except Exception as exc:  # noqa: BLE001 - best effort: the compiler or the minifier may fail
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    files = sorted(str(p.relative_to(outdir)) for p in outdir.rglob("*.py")) if outdir.is_dir() else []
    out.update(minifier_dir=str(outdir), repro_files=files)
    return out
