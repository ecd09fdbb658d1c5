"""Activations at a capture: one forward of the captured batch through the run's recipe.

The model is built by the run's recipe (imported after the replay's ownership checks, see
:mod:`sentineld.replay.trust`), loaded with the capture's snapshot (the state before step S) and
run on step S's batch with step S's RNG state, so what the histograms show is what the first
forward of step S computed. Every leaf module's floating output is recorded by a forward hook.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from sentineld.contracts.capture import open_capture
from sentineld.contracts.recipe import Recipe
from sentineld.contracts.rng import restore_rng
from sentineld.contracts.rundir import RunMeta

from . import data as d

__all__ = ["capture_activations"]


def _recipe(meta: RunMeta, cap_path: Path, run_dir: Path, trust: bool) -> Recipe:
    from sentineld.contracts.trust import check_import_path  # noqa: PLC0415
    from sentineld.replay.trust import load_recipe_factory  # noqa: PLC0415

    if not trust:  # the replay's checks: the import path first, then the recipe's own files
        check_import_path()
    from sentineld.replay.live_recipe import recipe_of  # noqa: PLC0415

    found = recipe_of(meta)
    if found is None:
        raise ValueError("the run recorded no recipe and no loss_fn")
    spec, args = found
    fn = load_recipe_factory(spec, meta.cwd, trust=trust,
                             named_by=[p for p in (run_dir / "run.json", cap_path) if p.exists()])
    rec = fn(**args)
    if not isinstance(rec, Recipe):
        raise TypeError(f"recipe {spec} returned {type(rec).__name__}, not sentineld.recipe.Recipe")
    return rec


def _forward(rec: Recipe, batch: Any, rng: Any) -> dict[str, torch.Tensor]:
    outs: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in rec.model.named_modules():
        if name and not any(True for _ in mod.children()):
            def hook(_m: Any, _a: Any, out: Any, name: str = name) -> None:
                if isinstance(out, torch.Tensor) and out.is_floating_point() and name not in outs:
                    outs[name] = out.detach().float().cpu()
            handles.append(mod.register_forward_hook(hook))
    mb = batch[0] if rec.accumulation_steps > 1 else batch
    ctx = (torch.autocast(next(rec.model.parameters()).device.type, dtype=rec.autocast_dtype)
           if rec.autocast_dtype is not None else contextlib.nullcontext())
    try:
        if rng is not None:
            restore_rng(dict(rng))
        with torch.no_grad(), ctx:
            rec.loss_fn(rec.model, mb)
    finally:
        for h in handles:
            h.remove()
    return outs


def capture_activations(run_dir: Path, meta: RunMeta, cap_path: Path, trust: bool) -> tuple[list[d.Hist], str]:
    """Histograms of each leaf module's output on the capture's snapshot step.

    Returns:
        ``(hists, note)``: at most :data:`~sentineld.report.data.MAX_HISTS` histograms in
        module order, and a sentence saying what was run, or why nothing could be (no recipe, an
        untrusted or failing recipe); never raises for the user's code.
    """
    from sentineld.replay.live_recipe import recipe_of  # noqa: PLC0415

    found = recipe_of(meta)
    if found is None:
        return [], ("activations unavailable: the run recorded neither a recipe nor a loss_fn (attach(..., "
                    "loss_fn=...) or recipe='module:function') to run the captured batch through")
    from sentineld.replay.rebuild import load_snapshot, rebuild, torch_globals  # noqa: PLC0415

    try:
        with open_capture(cap_path) as cap:
            s, n = cap.snapshot_step, cap.first_step
            snap = cap.snapshot()
            losses = {int(r["step"]): float(r["loss"]) for r in cap.records()
                      if isinstance(r, dict) and "step" in r and isinstance(r.get("loss"), (int, float))}
            flags = meta.extra.get("torch_flags") if isinstance(meta.extra, dict) else None
            with torch_globals(meta.num_threads, flags if isinstance(flags, dict) else None):
                rec = _recipe(meta, cap_path, run_dir, trust)
                load_snapshot(rec, snap)
                # The incident's own batch on the state before it: steps S..N-1 re-executed first,
                # so the culprit's output is what the offending step computed.
                rebuild(rec, range(s, n), lambda k: (cap.step(k).batch, cap.step(k).rng), losses)
                st = cap.step(n)
                outs = _forward(rec, st.batch, st.rng)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code can raise anything
        return [], f"activations unavailable: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    hists = [d.hist(name, t.numpy(), "float32") for name, t in list(outs.items())[:d.MAX_HISTS]]
    how = "the run's recorded model and loss_fn" if found[0].startswith("sentineld.replay.live_recipe") \
        else f"recipe {found[0]}"
    note = (f"outputs of {len(outs)} leaf modules in one forward of the incident step {n}'s batch, on the state "
            f"before step {n} (snapshot {s} and steps {s}..{n - 1} re-executed), through {how}")
    return hists, note
