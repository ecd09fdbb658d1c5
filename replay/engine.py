"""Rebuild the state before an offending step and localize the first non-finite value in it.

Method (``debugging-and-diagnosis.txt``, "binary replay"): find the first bad step, restore the
model state and the batch of that step, and re-run it in isolation. Here the state at step N is
rebuilt from snapshot S by re-executing S..N-1 with the recorded batches and RNG states; each
rebuilt loss is compared with the recorded one (bitwise on CPU). If the rebuild itself turns
non-finite before N (detection ran a step late, or the optimizer broke the parameters one step
before the loss showed it), that earlier step is the offending one.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from sentineld.capture import Capture, CaptureError, open_capture
from sentineld.recipe import Recipe, train_step
from sentineld.rng import restore_rng
from sentineld.rundir import RunMeta, list_captures, read_run_meta
from sentineld.treecodec import map_tensors

from .causes import likely_cause
from .report import Report
from .trace import Birth, Tracer, tensor_stats
from .trust import RecipeError, load_recipe_factory

__all__ = ["ReplayError", "NotReproducedError", "replay_run", "find_capture"]

log = logging.getLogger("sentineld.replay")


class ReplayError(Exception):
    """Bad input for a replay (no capture for the step, no recipe, a model that cannot be built)."""


class NotReproducedError(Exception):
    """Kept for callers that want to raise on a non-reproduced report (the CLI uses exit code 1)."""


def find_capture(run_dir: Path, step: int | None) -> Path:
    """The capture holding ``step`` (or the earliest incident capture when ``step`` is None).

    Raises:
        ReplayError: the run has no capture, or none holds ``step`` (lists the steps that exist).
    """
    caps = list_captures(run_dir)
    if not caps:
        raise ReplayError(f"{run_dir}: no capture-*.h5 in this run; a capture is written when the "
                          "agent sees a non-finite loss or grad norm, or on a crash")
    if step is None:
        incidents = [c for c in caps if c[2] == "nonfinite"] or caps
        return incidents[0][3]
    spans = []
    for _rank, _n, _trigger, path in caps:
        try:
            with open_capture(path) as cap:
                steps = cap.steps
        except CaptureError as exc:
            log.warning("skipping %s", exc)
            continue
        if step in steps:
            return path
        if steps:
            spans.append(f"{steps[0]}..{steps[-1]} ({path.name})")
    raise ReplayError(f"step {step} is in no capture of {run_dir.name}; captured steps: "
                      f"{', '.join(spans) or 'none readable'}")


def _to_device(tree: Any, device: torch.device) -> Any:
    return map_tensors(tree, lambda t: t.to(device))


def _params_finite(model: torch.nn.Module) -> bool:
    ps = [p.detach() for p in model.parameters()]
    return all(bool(torch.isfinite(p).all()) for p in ps)


def _nonfinite_fields(batch: Any, path: str = "batch") -> list[dict[str, Any]]:
    """Fields of the batch holding NaN/Inf, with the sample indices (dim 0) affected."""
    found: list[dict[str, Any]] = []
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() and not bool(torch.isfinite(batch).all()):
            bad = ~torch.isfinite(batch)
            rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist() if batch.dim() else []
            found.append({"field": path, "samples": rows[:32], "count": int(bad.sum()),
                          "stats": tensor_stats(batch)})
    elif isinstance(batch, dict):
        for k, v in batch.items():
            found += _nonfinite_fields(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            found += _nonfinite_fields(v, f"{path}[{i}]")
    return found


def _lr(recipe: Recipe) -> float | None:
    groups = recipe.optimizer.param_groups
    return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _build(meta: RunMeta, recipe_spec: str | None, trust: bool, named_by: list[Path]) -> Recipe:
    spec = recipe_spec or meta.recipe
    if not spec:
        raise ReplayError(f"run {meta.run_id} recorded no recipe; pass --recipe module:function "
                          "(a function returning sentineld.recipe.Recipe)")
    factory = load_recipe_factory(spec, meta.cwd, trust=trust, named_by=named_by)
    try:
        recipe = factory(**meta.recipe_args)
    except Exception as exc:  # noqa: BLE001
        raise ReplayError(f"recipe {spec} raised while building the model: "
                          f"{type(exc).__name__}: {exc}") from None
    if not isinstance(recipe, Recipe):
        raise ReplayError(f"recipe {spec} returned {type(recipe).__name__}, not sentineld.recipe.Recipe")
    return recipe


def _tensor_names(recipe: Recipe) -> dict[int, str]:
    names: dict[int, str] = {}
    pname = {id(p): n for n, p in recipe.model.named_parameters()}
    for p in recipe.model.parameters():
        n = pname.get(id(p), "?")
        names[p.data_ptr()] = n
        if p.grad is not None:
            names[p.grad.data_ptr()] = f"{n}.grad"
        for k, v in recipe.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                names[v.data_ptr()] = f"{n}:{k}"
    return names


def _run_steps(recipe: Recipe, cap: Capture, steps: range, recorded: dict[int, float],
               device: torch.device) -> tuple[float, bool, int | None]:
    """Re-execute ``steps``; return (max |loss deviation|, all equal, first step that broke state)."""
    max_dev, equal = 0.0, True
    for s in steps:
        st = cap.step(s)
        if st.rng is not None:
            restore_rng(dict(st.rng))
        loss = float(train_step(recipe, _to_device(st.batch, device)))
        rec = recorded.get(s)
        if rec is not None:
            if not _same(loss, rec):
                equal = False
                if math.isfinite(loss) and math.isfinite(rec):
                    max_dev = max(max_dev, abs(loss - rec))
                else:
                    max_dev = math.inf
        lr = _lr(recipe)
        if not math.isfinite(loss) or not _params_finite(recipe.model) or (lr is not None and not math.isfinite(lr)):
            return max_dev, equal, s
    return max_dev, equal, None


def replay_run(run_dir: str | Path, step: int | None = None, *, recipe: str | None = None,
               trust: bool = False, capture: str | Path | None = None) -> Report:
    """Replay a run's offending step and return the verdict.

    Args:
        run_dir: the run directory.
        step: the step to explain; default the capture's first non-finite step.
        recipe: ``module:function`` overriding the one in run.json.
        trust: import the recipe without ownership checks.
        capture: a specific capture file (default: the one holding ``step``).

    Raises:
        ReplayError, CaptureError, RunDirError, RecipeError, UntrustedError: bad input, each with a
            message saying what to do. Exceptions raised by the model code during re-execution
            propagate as ReplayError.
    """
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    meta = read_run_meta(run_dir)
    cap_path = Path(capture) if capture else find_capture(run_dir, step)
    with open_capture(cap_path) as cap:
        target = cap.first_step if step is None else step
        if target not in cap.steps:
            cap.step(target)  # raises CaptureError listing the steps held
        named_by = [run_dir / "run.json", cap_path] if (run_dir / "run.json").exists() else [cap_path]
        rec = _build(meta, recipe, trust, named_by)
        torch.set_num_threads(max(1, meta.num_threads))
        device = next((p.device for p in rec.model.parameters()), torch.device("cpu"))
        records = {int(r["step"]): float(r["loss"]) for r in cap.records() if "step" in r and "loss" in r}
        rec.load_state(_to_device(cap.snapshot(), device))
        S = cap.snapshot_step
        last = cap.steps[-1]
        try:
            dev, equal, broke = _run_steps(rec, cap, range(S, target), records, device)
            offending = target
            if broke is not None:
                # State went non-finite before the requested step: that step is the offending one.
                offending = broke
                rec = _build(meta, recipe, True, [])
                rec.load_state(_to_device(cap.snapshot(), device))
                dev, equal, _ = _run_steps(rec, cap, range(S, offending), records, device)
            while True:
                report = _localize(rec, cap, offending, records, device)
                loss = report.evidence.get("replayed_loss", math.nan)
                if report.phase != "none" or step is not None or offending >= last:
                    break
                # Auto mode: the trigger step re-ran finite (e.g. only the grad norm overflowed);
                # follow the captured steps after it to where a value really went non-finite.
                if offending in records and not _same(loss, records[offending]):
                    equal = False
                    dev = max(dev, abs(loss - records[offending]) if math.isfinite(loss) else math.inf)
                offending += 1
        except (CaptureError, ReplayError):
            raise
        except Exception as exc:  # noqa: BLE001 - the user's model code raised
            raise ReplayError(f"re-executing the run's step failed: {type(exc).__name__}: {exc}") from exc
    report.requested_step = target
    report.steps_rebuilt = offending - S
    report.max_loss_deviation = dev
    rec_nf = records.get(offending)
    report.recorded_nonfinite = rec_nf is not None and not math.isfinite(rec_nf)
    replay_nf = report.phase != "none"
    same_outcome = True
    if rec_nf is not None:
        same_outcome = _same(report.evidence.get("replayed_loss", float("nan")), rec_nf) or (
            replay_nf and report.recorded_nonfinite)
    report.reproduced = equal and same_outcome
    report.run_id, report.rank, report.capture = meta.run_id, cap.rank, str(cap_path)
    report.elapsed_s = time.perf_counter() - t0
    return report


def _localize(recipe: Recipe, cap: Capture, step: int, records: dict[int, float],
              device: torch.device) -> Report:
    st = cap.step(step)
    batch = _to_device(st.batch, device)
    report = Report(run_id="", rank=0, step=step, requested_step=step, phase="none")
    bad_fields = _nonfinite_fields(batch)
    if bad_fields:
        first = bad_fields[0]
        cause, fix = likely_cause("data", None, None, [], {})
        report.phase, report.cause, report.fix = "data", cause, fix
        report.evidence = {"field": first["field"], "samples": first["samples"],
                           "fields": bad_fields, "recorded_loss": records.get(step)}
        return report
    if st.rng is not None:
        restore_rng(dict(st.rng))
    tracer = Tracer(recipe.model, _tensor_names(recipe))
    seen: dict[str, Any] = {}
    pnames = {id(p): n for n, p in recipe.model.named_parameters()}

    def on_phase(phase: str) -> None:
        if phase in ("clip", "optimizer") and "grads_before" not in seen:
            seen["grads_before"] = {pnames.get(id(p), "?"): bool(torch.isfinite(p.grad).all())
                                    for p in recipe.model.parameters() if p.grad is not None}
        if phase == "optimizer":
            seen["lr"] = _lr(recipe)
        tracer.set_phase(phase)

    with tracer:
        loss = float(train_step(recipe, batch, on_phase=on_phase))
    nonfinite_params = [n for n, p in recipe.model.named_parameters() if not bool(torch.isfinite(p).all())]
    nonfinite_grads = [n for n, k in seen.get("grads_before", {}).items() if not k]
    lr = seen.get("lr")
    report.evidence = {"replayed_loss": loss, "recorded_loss": records.get(step), "lr": lr,
                       "ops_observed": tracer.op_count,
                       "births": [_birth_summary(b) for b in tracer.births[:5]]}
    if tracer.module_birth is not None:
        mb = tracer.module_birth
        report.evidence["first_nonfinite_module"] = {"module": mb.module, "module_type": mb.module_type,
                                                     "inputs": mb.inputs, "output": mb.output}
    all_finite = math.isfinite(loss) and not nonfinite_params and not nonfinite_grads and (
        lr is None or math.isfinite(lr))
    if all_finite:
        report.cause, report.fix = likely_cause("none", None, None, [], {})
        return report
    if lr is not None and not math.isfinite(lr) and not any(b.phase in ("forward", "backward") for b in tracer.births):
        report.phase = "optimizer"
        report.module = "lr_scheduler"
        report.module_type = type(recipe.scheduler).__name__ if recipe.scheduler is not None else None
        report.op = "lr"
        report.parameters = nonfinite_params
        report.cause, report.fix = likely_cause("optimizer", None, None, [], {}, lr=lr)
        return report
    culprit = _choose(tracer.births)
    if culprit is None:
        # Non-finite without a birth: it came from the state (e.g. parameters already non-finite).
        report.phase = "optimizer" if nonfinite_params else "forward"
        report.parameters = nonfinite_params
        report.cause = "non-finite values were already in the rebuilt state"
        report.fix = "replay an earlier step (--step) to find where they were made"
        return report
    clip_nan = next((b for b in tracer.births if b.phase == "clip" and b.kind == "nan"), None)
    phase = {"clip": "optimizer", "scheduler": "optimizer"}.get(culprit.phase, culprit.phase)
    use = culprit
    if clip_nan is not None and culprit.phase in ("backward", "clip"):
        phase, use = "optimizer", clip_nan
        report.evidence["inf_gradient_origin"] = _birth_summary(culprit)
    report.phase = phase
    report.op = use.op
    report.autograd_node = culprit.autograd_node
    module, mtype = culprit.module, culprit.module_type
    if phase == "forward" and (module is None or module.startswith("<")):
        mtype = module.strip("<>") if module else "function"
        module = "loss"
    report.module, report.module_type = module, mtype
    if phase == "forward":
        report.parameters = [n for n, _ in _module_params(recipe.model, culprit.module)]
    elif phase == "backward":
        report.parameters = nonfinite_grads or nonfinite_params
    else:
        report.parameters = nonfinite_params or nonfinite_grads or use.tensor_names
    report.evidence["op_inputs"] = use.inputs
    report.evidence["op_output"] = use.output
    if use.tensor_names:
        report.evidence["tensors"] = use.tensor_names
    cause, fix = likely_cause(phase, use.op, use.kind, use.inputs, use.output, lr=lr,
                              clip=use.phase == "clip", node=culprit.autograd_node)
    report.cause, report.fix = cause, fix
    return report


def _choose(births: list[Birth]) -> Birth | None:
    """The first birth in execution order; an Inf born before the first NaN is its likelier root."""
    return births[0] if births else None


def _module_params(model: torch.nn.Module, name: str | None) -> list[tuple[str, torch.Tensor]]:
    if not name or name.startswith("<"):
        return []
    for mname, m in model.named_modules():
        if mname == name:
            return [(f"{name}.{pn}" if name else pn, p) for pn, p in m.named_parameters(recurse=False)]
    return []


def _birth_summary(b: Birth) -> dict[str, Any]:
    return {"phase": b.phase, "kind": b.kind, "op": b.op, "module": b.module,
            "autograd_node": b.autograd_node, "output": b.output}
