"""``sentineld replay`` of a run with neither recipe nor loss_fn: forward-only, from the capture.

Such a run records its model's top-level forward calls in the capture (``/forward``) and its model
class in ``run.json`` (``extra.model_class``, ``module:QualName``). When the class can be imported
from the run's working directory (after the same ownership checks as a recipe) and built without
arguments, the replay loads the snapshot's parameters into it and runs
:func:`replay.forward_only.localize_forward`, as the training process itself does. Otherwise it says
what to pass.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from sentineld.contracts.capture import open_capture
from sentineld.contracts.rng import restore_rng
from sentineld.contracts.rundir import RunMeta
from sentineld.contracts.verdict import Replayed
from sentineld.contracts.verdict_file import verdict_path

from .errors import ReplayError
from .forward_only import HOW_TO_ENABLE, ForwardCall, localize_forward
from .rebuild import torch_globals
from .trust import load_recipe_factory

__all__ = ["replay_forward_only"]


def _from_structure(meta: RunMeta, trust: bool, named_by: list[Path]) -> torch.nn.Module | None:
    """The model rebuilt from the structure the run recorded at attach (constructor arguments and
    a class of the training script included), or None for a run that recorded none."""
    from sentineld.contracts.structure import StructureError, build_module  # noqa: PLC0415
    from sentineld.contracts.trust import check_owned  # noqa: PLC0415

    from .live_recipe import Loader  # noqa: PLC0415
    from .trust import _TRUST  # noqa: PLC0415

    tree = meta.extra.get("model_structure") if isinstance(meta.extra, dict) else None
    if not isinstance(tree, dict):
        return None
    if not trust:
        for f in named_by:
            check_owned(f)
    _TRUST.set(trust)
    try:
        return build_module(tree, Loader(meta.cwd, trust))
    except StructureError as exc:
        raise ReplayError(f"run {meta.run_id} recorded no recipe, and its model cannot be rebuilt from what "
                          f"it recorded: {exc}") from None


def _model(meta: RunMeta, trust: bool, named_by: list[Path]) -> torch.nn.Module:
    built = _from_structure(meta, trust, named_by)
    if built is not None:
        return built
    spec = meta.extra.get("model_class") if isinstance(meta.extra, dict) else None
    if not isinstance(spec, str) or spec.startswith("__main__:"):
        raise ReplayError(f"run {meta.run_id} recorded no recipe, and its model class "
                          f"({spec or 'not recorded'}) cannot be imported; {HOW_TO_ENABLE}, or pass "
                          "--recipe module:function")
    cls = load_recipe_factory(spec, meta.cwd, trust=trust, named_by=named_by)
    try:
        model = cls()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code
        raise ReplayError(f"run {meta.run_id} recorded no recipe, and its model class {spec} cannot be "
                          f"built without arguments ({type(exc).__name__}: {exc}); {HOW_TO_ENABLE}, "
                          "or pass --recipe module:function") from None
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"{spec} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def replay_forward_only(meta: RunMeta, cap_path: Path, trust: bool, named_by: list[Path]) -> Replayed:
    """Forward-only verdict for ``cap_path`` of a run without a recipe.

    Raises:
        ReplayError: the capture holds no forward calls, or the model cannot be imported or built
            (the message says what to pass instead).
    """
    with open_capture(cap_path) as cap:
        calls_rec = cap.forward_calls()
        if not calls_rec:
            verdict = verdict_path(cap_path)
            raise ReplayError(f"run {meta.run_id} recorded no recipe; pass --recipe module:function "
                              "(a function returning sentineld.recipe.Recipe)"
                              + (f"; the training process's own verdict is in {verdict}" if verdict.exists() else ""))
        model = _model(meta, trust, named_by)
        snap = cap.snapshot()
        own = dict(model.named_parameters()) | dict(model.named_buffers())
        for name, t in (snap.get("model") or {}).items():
            cur = own.get(name)
            if cur is not None and cur.is_floating_point() and t.is_floating_point() and cur.dtype != t.dtype:
                cur.data = cur.data.to(t.dtype)
        try:
            model.load_state_dict(snap["model"])
        except (RuntimeError, KeyError) as exc:
            # The class was rebuilt without the constructor arguments the run used (an empty
            # nn.Sequential, a default width): say that, and how to give them, not just "mismatch".
            raise ReplayError(f"run {meta.run_id} recorded no recipe, and {type(model).__name__}() built "
                              "without arguments does not match the captured state (the model was made "
                              "with constructor arguments the replay cannot know): pass --recipe "
                              f"module:function, or {HOW_TO_ENABLE}; torch said: "
                              f"{' '.join(str(exc).split())[:300]}") from None
        model.train()
        calls = [ForwardCall(s, tuple(c["args"]), dict(c["kwargs"]), dict(r) if (r := cap.step(s).rng) else None)
                 for s, c in sorted(calls_rec.items()) if s in cap.steps]
        flags = meta.extra.get("torch_flags") if isinstance(meta.extra, dict) else None
        cast = next((c.get("autocast") for c in calls_rec.values() if isinstance(c, dict) and c.get("autocast")), None)
        dtype = getattr(torch, str(cast), None) if cast else None
        losses = {int(r["step"]): float(r["loss"]) for r in cap.records()
                  if isinstance(r, dict) and "step" in r and isinstance(r.get("loss"), (int, float))}
        with torch_globals(meta.num_threads, flags if isinstance(flags, dict) else None) as in_effect:
            found = localize_forward(model, cap.snapshot_step, calls, cap.first_step, restore_rng,
                                     autocast_dtype=dtype if isinstance(dtype, torch.dtype) else None,
                                     recorded_losses=losses)
    return replace(found, rank=cap.rank, capture=str(cap_path), evidence={**found.evidence, "torch_flags": in_effect})
