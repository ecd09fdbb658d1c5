"""What a verdict means for a ``torch.compile``'d run: the replay ran the model eagerly.

The agent attaches to the compiled module (its hooks run outside the compiled graph, so no graph
break is added; per-layer probes are off for a compiled model, see :mod:`sentineld.agent.watch`),
captures at the step boundary (state dicts of the module inside the wrapper), and the replay's
recipe builds the plain, eager model: the rebuild and the localization are eager, with the same
dispatch tracing as for any run. So the verdict says so:

- ``compiled``: true (from run.json ``extra.compiled``; ``extra.compile_backend`` names the backend).
- ``eager_reproduced``: the eager replay made a non-finite value at the run's non-finite step (for a
  loss-spike verdict: the spike, its cause named), with every rebuilt loss before it (and a spike's
  replayed loss) within :data:`REL_TOLERANCE` of the recorded (compiled) one.
  A compiler's fused kernels reorder float sums, so eager and compiled losses may differ in the
  last bits; ``reproduced`` for a compiled run accepts that tolerance and says it used it
  (``loss_tolerance``), as the DDP replay does for gloo's ring order.
- When eager does not make the fault, the fault is the compiler's (or a transient): the
  evidence says so, and names what a user runs next (the accuracy minifier on the captured
  step, ``TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from sentineld.contracts.capture import CaptureError, open_capture
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
    spike = r.found.kind == "spike"
    # The capture was written because the compiled run went non-finite (or its loss spiked) at its
    # incident step; a verdict with a phase (a spike verdict naming a cause) is the eager replay
    # making the same fault there.
    eager_reproduced = bool((r.found.cause_class != "not_reproduced" if spike else r.found.phase != "none")
                            and within)
    ev: dict[str, Any] = {"backend": extra.get("compile_backend"), "replayed": "eager",
                          "tolerance": tol, "max_deviation": worst, "eager_reproduced": eager_reproduced}
    if not eager_reproduced:
        fault = "loss spike" if spike else "non-finite value"
        ev["note"] = (f"the eager replay does not make the run's {fault}: the compiled graph (or a "
                      "transient) does. Re-run the captured step compiled under the accuracy minifier: "
                      "TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4, with the captured batch")
        if rerun is not None and not spike:  # the compiled re-run looks for a non-finite value only
            ev["compiled_rerun"] = rerun(extra.get("compile_backend"))
    accepted = within and not r.reproduced and bool(recorded)
    return CompiledCheck(eager_reproduced, ev, tolerance=tol if accepted else None,
                         max_loss_deviation=worst if accepted else 0.0)


#: Wall seconds the compiled re-run under the minifier may take (a cold inductor compile of a
#: small model took 159 s on the loaded 2-core test machine); then its process group is killed.
RERUN_TIMEOUT_S = 600.0
#: The minifier's own settings, as its documentation names them (read by dynamo at import).
MINIFIER_ENV = {"TORCHDYNAMO_REPRO_AFTER": "aot", "TORCHDYNAMO_REPRO_LEVEL": "4"}


def compiled_rerun(cap_path: Path, run_dir: Path, recipe: str | None, trust: bool, step: int,
                   backend: str | None, timeout_s: float = RERUN_TIMEOUT_S) -> dict[str, Any]:
    """Re-run ``step`` of the capture compiled under the accuracy minifier, in a child process.

    The child (``python -I -m sentineld.replay.compiled``, working folder and debug dir
    ``<capture>.minifier/``, environment :data:`MINIFIER_ENV`) rebuilds the state before ``step``
    eagerly from the snapshot and the captured batches, compiles the recipe's model with the run's
    backend and runs the captured step with its real batch and RNG state. With
    ``TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4`` (only when the plain compiled re-run
    is non-finite: the minifier's check fails on any graph with dropout, see :data:`RANDOM_OPS`)
    dynamo checks each AOT forward graph
    against an fp64 eager run on those real inputs and, when one fails, writes it as a repro
    (``repro.py`` in the working folder, ``minifier/checkpoints/<nodes>.py``, and the
    ``minifier_launcher.py`` that shrinks it). A child: the minifier's settings are process-wide,
    and a compile that hangs or crashes is killed after ``timeout_s`` without taking the replay.

    Returns:
        ``{"backend", "loss", "nonfinite", "minified", "accuracy_failed", "minifier_dir",
        "repro_files", "repro", "repro_draws_random", "repro_note"}``: ``repro`` the path of the
        repro script, or None and
        ``repro_note`` saying plainly why there is none; ``"error"`` when the re-run itself
        failed (never raises).
    """
    out: dict[str, Any] = {"backend": backend if isinstance(backend, str) and backend.strip() else "inductor"}
    if backend is not None and out["backend"] != backend:  # a hand-edited run.json: 5, "", a list
        out["backend_note"] = (f"run.json's extra.compile_backend is {backend!r}, not a torch.compile backend name; "
                               "re-ran with inductor (write the backend the run compiled with there to re-run that)")
    outdir = cap_path.with_suffix(".minifier")
    try:
        outdir.mkdir(mode=0o700, exist_ok=True)
        cmd = [sys.executable, "-I", "-m", "sentineld.replay.compiled", str(cap_path), str(run_dir), str(step),
               out["backend"], str(outdir)] + (["--recipe", recipe] if recipe else []) + (["--trust"] if trust else [])
        env = {**os.environ, **MINIFIER_ENV, "TORCH_COMPILE_DEBUG_DIR": str(outdir)}
        proc = subprocess.Popen(cmd, cwd=outdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
            got = outdir / "rerun.json"
            if got.is_file():
                out.update(json.loads(got.read_text()))
            else:
                out["error"] = f"the compiled re-run exited {proc.returncode}: {(err or '').strip()[-300:]}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            out["error"] = f"the compiled re-run did not finish within {timeout_s:.0f} s (killed)"
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    files = sorted(str(p.relative_to(outdir)) for p in outdir.rglob("*.py")) if outdir.is_dir() else []
    repro = outdir / "repro.py" if (outdir / "repro.py").is_file() else None
    random = repro is not None and any(op in repro.read_text(errors="replace") for op in RANDOM_OPS)
    out.update(minifier_dir=str(outdir), repro_files=files, repro=str(repro) if repro else None,
               repro_draws_random=random)
    out["repro_note"] = _repro_note(out, step)
    return out


def _repro_note(out: dict[str, Any], step: int) -> str:
    """Why the minifier wrote a repro, or plainly why not (the verdict names no missing file)."""
    if out.get("repro"):
        note = (f"the compiled re-run of step {step} is non-finite, and the accuracy minifier found an AOT graph "
                f"whose compiled output differs from its fp64 eager run on the step's real inputs; repro: "
                f"{out['repro']} (python repro.py re-runs it with those inputs; "
                "minifier/minifier_launcher.py under torch_compile_debug/ shrinks it)")
        if out.get("repro_draws_random"):
            note += (". Caution: the graph draws random numbers (dropout), and the minifier runs eager, fp64 and "
                     "compiled with different draws, so its check fails on such a graph whatever the compiler "
                     "does: compare the values, not only the verdict")
        return note
    if "error" in out and "InvalidBackend" in out["error"]:
        return (f"no repro: the run's backend {out['backend']!r} (run.json's extra.compile_backend) is not one this "
                "torch has (torch._dynamo.list_backends() names them); write the backend the run compiled with "
                "there, or inductor, and replay again")
    if "error" in out:
        return f"no repro: the compiled re-run failed ({out['error']})"
    if out["backend"] != "inductor":
        return (f"no repro: torch's accuracy minifier (TORCHDYNAMO_REPRO_LEVEL=4) checks inductor graphs only "
                f"(torch: 'Accuracy minification is supported for inductor only'); the run's backend "
                f"{out['backend']} is not wrapped by it. Re-run step {step} compiled with inductor to check "
                "that compiler")
    if not out.get("nonfinite"):
        return (f"no repro: the compiled re-run of step {step} from the captured state and batch is finite too, so "
                "the fault did not come from the compiled graph on those inputs (a transient, or something the "
                "capture does not hold); the minifier had no failing graph to write")
    return (f"no repro: the compiled re-run of step {step} is non-finite, but every AOT forward graph matched its "
            "fp64 eager run (the minifier compares forward graphs only, NaN equal to NaN: a NaN the fp64 run "
            "makes too is no accuracy failure), so it wrote none")


#: Ops in a repro's graph that draw random numbers: the minifier runs the eager, the fp64 and the
#: compiled graph one after the other without resetting the RNG (``same_two_models``), so such a
#: graph (dropout in training mode) fails its accuracy check whatever the compiler does.
RANDOM_OPS = ("inductor_random", "inductor_seeds", "aten.bernoulli", "aten.rand", "native_dropout", "philox")


def _no_compile_caches() -> Any:
    """Inductor's FX graph cache and AOT autograd's cache off (a context manager)."""
    import contextlib  # noqa: PLC0415

    import torch._functorch.config as functorch_config  # noqa: PLC0415
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def _rerun_child(cap_path: Path, run_dir: Path, step: int, backend: str, outdir: Path, recipe: str | None,
                 trust: bool) -> dict[str, Any]:
    """The child's body: the state before ``step`` rebuilt eagerly, then the step compiled twice:
    plainly (does the compiled graph make a non-finite value from the captured inputs?) and,
    only when it does, again from a fresh rebuild under the minifier (the environment's
    ``TORCHDYNAMO_REPRO_*``), so a finite step never gets a spurious repro."""
    import torch  # noqa: PLC0415
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415

    from sentineld.contracts.rundir import RunDir, read_run_meta  # noqa: PLC0415

    from .rebuild import torch_globals  # noqa: PLC0415
    from .run_recipe import recipe_factory  # noqa: PLC0415

    meta = read_run_meta(run_dir)
    make = recipe_factory(meta, recipe, trust, [p for p in (run_dir / RunDir.RUN_JSON, cap_path) if p.exists()])
    flags = meta.extra.get("torch_flags") if isinstance(meta.extra.get("torch_flags"), dict) else None
    res: dict[str, Any] = {"accuracy_failed": False, "minified": False}
    with open_capture(cap_path) as cap, torch_globals(meta.num_threads, flags):
        recs = {int(r["step"]): r for r in cap.records() if isinstance(r, dict) and "step" in r}
        losses = {s: float(r["loss"]) for s, r in recs.items() if isinstance(r.get("loss"), (int, float))}

        def load(s: int) -> tuple[Any, Any]:
            st = cap.step(s)
            return st.batch, st.rng

        def compiled_step() -> tuple[float, bool]:
            rec = make()
            load_snapshot(rec, cap.snapshot())
            rebuild(rec, range(cap.snapshot_step, step), load, losses)
            batch, rng = load(step)  # the same recorded RNG state each time: the same dropout draws
            torch._dynamo.reset()
            module: Any = torch.compile(rec.model, backend=backend)  # an OptimizedModule
            loss = run_step(replace(rec, model=module), batch, rng)
            return loss, not math.isfinite(loss) or state_nonfinite(rec)

        with dynamo_config.patch(repro_after=None):
            loss, bad = compiled_step()
        res.update(loss=loss, nonfinite=bad)
        if bad:
            res["minified"] = True
            try:
                # Caches off: a graph found in inductor's FX graph cache or AOT autograd's cache (the
                # run compiled it already) skips the compiler, and with it the minifier's wrapper.
                with _no_compile_caches():
                    compiled_step()
            except Exception as exc:  # the minifier's AccuracyError is its finding, not a failure
                if type(exc).__name__ != "AccuracyError" and "Bad accuracy detected" not in str(exc):
                    raise
                res["accuracy_failed"] = True
    del outdir  # the minifier writes there by its working folder and TORCH_COMPILE_DEBUG_DIR
    return res


def _main(argv: list[str]) -> int:
    """``python -m sentineld.replay.compiled CAPTURE RUN_DIR STEP BACKEND OUTDIR [--recipe S] [--trust]``."""
    import argparse  # noqa: PLC0415

    from sentineld.contracts.trust import add_replay_path, check_import_path  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m sentineld.replay.compiled")
    for name in ("capture", "run_dir", "step", "backend", "outdir"):
        ap.add_argument(name)
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--trust", action="store_true")
    a = ap.parse_args(argv)
    outdir = Path(a.outdir)
    try:
        add_replay_path()
        if not a.trust:
            check_import_path()
        res = _rerun_child(Path(a.capture), Path(a.run_dir), int(a.step), a.backend, outdir, a.recipe, a.trust)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which never raises
        res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    (outdir / "rerun.json").write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
