"""An FSDP2 run's replay re-launched at its world size: ``sentineld replay RUN --world-size N``.

The consolidated replay (:mod:`.fsdp`) loads every shard into one process; a model whose
unsharded state does not fit the host needs the replay sharded as the run was. This module:

- :func:`relaunch` (the launcher, in the replay process): checks the request, then starts
  ``python -I -m torch.distributed.run --standalone --nproc-per-node N --no-python --
  <python> -I -m sentineld.replay.fsdp_relaunch ...`` (every rank keeps ``-I``: the run's
  interpreter, no working folder or ``$PYTHONPATH`` on the import path; the trusted replay path
  comes through ``$SENTINELD_REPLAY_PATH`` as for the consolidated replay), under a timeout,
  and reads back the verdict rank 0 wrote.
- :func:`worker` (each rank, gloo; NCCL as well for a CUDA recipe): builds the recipe, shards
  its model with ``fully_shard`` over a 1-D mesh of the N ranks, rebuilds the optimizer over
  the sharded parameters, loads its own shard of every parameter and Adam moment from the
  capture's DCP checkpoint (``dcp.load`` into the rank's DTensors: DCP reads only the offsets
  this rank owns) and the unsharded leaves (step, buffers, param groups) from its own HDF5
  capture, then re-executes S..N-1 on its own recorded batch and RNG states, with FSDP's own
  collectives, comparing its losses with its recorded ones. Step N runs under the tracer on
  every rank (non-finite checks on local shards: no collective inside the tracer). Every
  decision that changes what the ranks run next (a step that broke early, auto mode following
  a finite step) is agreed by an all-reduce, so no rank waits on a collective the others skip.

The verdict (rank 0, from every rank's finding): the earliest phase any rank found (data <
forward < backward < optimizer), preferring a rank that names an op (a rank whose only
non-finite values arrived through the reduce-scatter names none), lowest rank first; ``ranks``
are the ranks with that same finding, every rank for an optimizer fault (each rank's step is
the model's step on its shard). ``replayed_as`` says ``relaunched at world size N``.

Limits: N must equal the recorded world size (each rank re-executes its own recorded batch;
DCP could reshard the state to any N, but the batches of W ranks do not split into N);
the run's FSDP units and their ``MixedPrecisionPolicy`` come from run.json
(:mod:`sentineld.contracts.fsdpunits`): the same modules are sharded with the same policies, so
a bfloat16 run reproduces bit for bit; a run recorded before the units were gets units chosen
by size (:func:`units`) in the parameters' dtype; a scheduler is rebound to the rebuilt optimizer.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from sentineld.contracts.errors import BadInput

from .errors import ReplayError

__all__ = ["RELAUNCH_TIMEOUT_S", "UNIT_FRACTION", "relaunch", "units", "worker", "combine"]

#: Seconds the whole relaunched replay may take before its ranks are killed (the replay never hangs).
RELAUNCH_TIMEOUT_S = 3600.0
#: Seconds a rank's collective waits for the others (gloo's timeout) before it fails.
COLLECTIVE_TIMEOUT_S = 300
_ORDER = {"data": 0, "forward": 1, "backward": 2, "optimizer": 3}


def _check_request(run_dir: Path, world_size: int) -> Any:
    """The run's metadata, once ``world_size`` is a size this run can be re-launched at.

    Raises:
        ReplayError: N < 1, N not the recorded world size, a run that is not FSDP2-sharded, or no
            torch.distributed.run in this interpreter; each message says what to do instead.
    """
    from sentineld.contracts.rundir import list_captures, read_run_meta  # noqa: PLC0415

    if world_size < 1:
        raise ReplayError(f"--world-size must be >= 1, got {world_size}; pass the run's world size, "
                          "or omit --world-size for the consolidated replay in one process")
    meta = read_run_meta(run_dir)
    if meta.extra.get("sharded") != "fsdp2" and not any(run_dir.glob("capture-step*.dcp")):
        raise ReplayError(f"--world-size re-launches the replay of an FSDP2 (fully_shard) run; {meta.run_id} "
                          "is not sharded (its captures hold whole state): omit --world-size")
    if world_size != meta.world_size:
        raise ReplayError(f"--world-size {world_size}: run {meta.run_id} ran on {meta.world_size} ranks, and "
                          f"each rank re-executes its own recorded batch, so the relaunch needs exactly "
                          f"{meta.world_size} (DCP reshards the state to any size, the batches do not "
                          f"split); pass --world-size {meta.world_size}, or omit it for the consolidated replay")
    if not list_captures(run_dir):
        raise ReplayError(f"{run_dir}: no capture-*.h5 in this run; nothing to replay")
    if importlib.util.find_spec("torch.distributed.run") is None:
        raise ReplayError("torch.distributed.run (torchrun) is not importable in this interpreter; install a torch "
                          "built with distributed support, or omit --world-size for the consolidated replay")
    return meta


def relaunch(run_dir: str | Path, world_size: int, step: int | None = None, *, recipe: str | None = None,
             trust: bool = False, capture: str | Path | None = None,
             timeout_s: float = RELAUNCH_TIMEOUT_S) -> dict[str, Any]:
    """Re-launch the replay of an FSDP2 run on ``world_size`` ranks; return rank 0's verdict (JSON object).

    Args:
        run_dir: the run directory (already resolved).
        world_size: ranks to start; must be the recorded world size (see the module docstring).
        timeout_s: wall seconds before every rank is killed and a ReplayError raised.

    Raises:
        ReplayError: bad request (:func:`_check_request`), a rank failed (its message), or the
            timeout ran out.
    """
    run_dir = Path(run_dir)
    _check_request(run_dir, world_size)
    out = Path(tempfile.mkdtemp(prefix="sentineld-relaunch-"))
    try:
        cmd = [sys.executable, "-I", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(world_size), "--no-python", "--", sys.executable, "-I", "-m", "sentineld.replay.fsdp_relaunch",
               "--out", str(out), str(run_dir)]
        cmd += (["--step", str(step)] if step is not None else []) + (["--recipe", recipe] if recipe else [])
        cmd += (["--capture", str(capture)] if capture else []) + (["--trust"] if trust else [])
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own group: a timeout kills every rank
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ReplayError(f"the replay re-launched on {world_size} ranks did not finish within {timeout_s:.0f} s "
                              "(killed); a rank may be stuck in a collective: retry, or omit --world-size for the "
                              "consolidated replay") from None
        return read_outcome(out, world_size, proc.returncode, err or "")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def read_outcome(out: Path, world_size: int, returncode: int, stderr: str) -> dict[str, Any]:
    """What a finished relaunch left in ``out``: rank 0's verdict (JSON object), or the failure.

    Rank 0 writes ``verdict.json`` (atomically) only after the all-gather every rank reached with
    its finding, so a verdict file with no ``error-rank*.txt`` beside it is a finished replay even
    when torchrun's exit code is not 0: a rank that died in gloo's teardown after the work (SIGABRT,
    "terminate called without an active exception", seen in CI; see :func:`_leave`) lost nothing.

    Raises:
        ReplayError: a rank wrote its error (the first one's message), or there is no verdict (the
            exit code and the tail of torchrun's stderr).
    """
    errors = sorted(out.glob("error-rank*.txt"))
    if errors:
        raise ReplayError(f"the replay re-launched on {world_size} ranks failed on "
                          f"{errors[0].stem.removeprefix('error-')}: {errors[0].read_text().strip()}")
    verdict = out / "verdict.json"
    if verdict.is_file():
        return dict(json.loads(verdict.read_text()))
    raise ReplayError(f"the replay re-launched on {world_size} ranks exited {returncode} without a verdict; "
                      f"torchrun said: {stderr.strip()[-1500:]}")


# --- one rank -------------------------------------------------------------------------------------


#: A submodule becomes its own FSDP unit once the parameters it holds outside smaller units reach
#: this fraction of the model's: the all-gathered (unsharded) parameters at any moment are then
#: about one unit's, not the whole model's (the reason to relaunch instead of consolidating).
UNIT_FRACTION = 1 / 256


def units(model: Any, fraction: float = UNIT_FRACTION) -> list[str]:
    """Qualified names of the submodules to ``fully_shard`` before the root, deepest first.

    Post-order over ``named_modules()``: a module whose parameters not yet in a unit number at
    least ``fraction`` of the model's becomes a unit (the root takes the rest). Only for runs
    recorded without their units (run.json ``extra.fsdp_units``); the layout changes when
    parameters are all-gathered, not a parameter's shard nor the reduce-scatter's elementwise sum.
    """
    mods = list(model.named_modules())
    total = sum(p.numel() for p in model.parameters())
    free = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in mods}
    out: list[str] = []
    for name, _m in reversed(mods):  # reversed pre-order: every descendant before its parent
        if name and total and free[name] >= fraction * total:
            out.append(name)
        elif name:
            parent = name.rpartition(".")[0]
            free[parent] += free[name]
    return out


def _shard(rec: Any, world: int, recorded: list[Any] | None = None) -> tuple[Any, Any]:
    """``(recipe with its model fully_shard-ed over a 1-D mesh, the mesh)``; the optimizer is
    rebuilt over the sharded parameters with the same groups and hyperparameters.

    ``recorded``: the run's own units (:func:`sentineld.contracts.fsdpunits.read_units`): the
    same modules become units with the same mixed-precision policies, deepest first, the root
    last; without them (a run recorded before they were) the units are chosen by size
    (:func:`units`) in the parameters' dtype.

    Raises:
        ReplayError: a recorded unit is no submodule of the recipe's model.
    """
    import torch  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = rec.model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    name_of = {id(p): n for n, p in model.named_parameters()}
    old = rec.optimizer
    mesh = init_device_mesh(device.type, (world,))
    if recorded:
        order = {name: i for i, (name, _m) in enumerate(model.named_modules())}
        lost = [u.module for u in recorded if u.module not in order]
        if lost:
            raise ReplayError(f"the run's FSDP units {lost} are no submodules of the recipe's model; the recipe "
                              "must build the model the run trained (the same module names)")
        # Descendants first, the root ("") last; only the run's units (a root that was no unit
        # kept its parameters whole on every rank in the run too).
        for u in sorted(recorded, key=lambda u: -order[u.module]):
            fully_shard(model.get_submodule(u.module), mesh=mesh, mp_policy=u.policy())
    else:
        for name in units(model):
            fully_shard(model.get_submodule(name), mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[name_of[id(p)]] for p in g["params"]]}
              for g in old.param_groups]
    opt = type(old)(groups)
    if rec.scheduler is not None:
        rec.scheduler.optimizer = opt  # the scheduler's lr writes go to the optimizer the step uses
    return replace(rec, optimizer=opt), mesh


def _load_sharded(rec: Any, cap: Any, snapshot: dict[str, Any]) -> dict[str, Any]:
    """Load this rank's shards from the capture's DCP checkpoint into ``rec`` with the snapshot's
    unsharded leaves; return the evidence (checkpoint, tensors, load seconds)."""
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    from sentineld.contracts.dcpstate import dcp_errors, fill_sharded, placeholders  # noqa: PLC0415

    from .fsdp import damaged_checkpoint  # noqa: PLC0415
    from .rebuild import load_snapshot  # noqa: PLC0415

    t0 = time.perf_counter()
    path = cap.path.parent / (cap.sharded_state or "")
    if not cap.sharded_state or not (path / ".metadata").is_file():
        what = ("is missing" if not path.exists() else "is not a directory" if not path.is_dir()
                else "has no .metadata (incomplete)")
        raise ReplayError(f"{cap.path.name}: its DCP checkpoint {cap.sharded_state or '(none named)'} {what} in "
                          f"{cap.path.parent}; copy the whole {cap.sharded_state or '.dcp'}/ directory next to the "
                          "captures")
    params = dict(rec.model.named_parameters())
    order = [p for g in rec.optimizer.param_groups for p in g["params"]]  # state_dict()'s numbering
    try:
        dtypes = {k: md.properties.dtype for k, md in
                  dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata)}
    except dcp_errors() as exc:  # a damaged .metadata
        raise ReplayError(damaged_checkpoint(path, ".metadata", exc)) from None
    templates: dict[str, Any] = {}
    for key in placeholders(snapshot):
        parts = key.split("/")
        if parts[0] == "model" and "/".join(parts[1:]) in params:
            like = params["/".join(parts[1:])]
        elif (parts[:2] == ["optimizer", "state"] and len(parts) == 4 and parts[2].isdigit()
              and int(parts[2]) < len(order)):
            like = order[int(parts[2])]
        else:
            raise ReplayError(f"sharded state {key!r} of {cap.path.name} has no DTensor in the recipe's sharded model; "
                              "the recipe's model or optimizer differs from the run's")
        # A DTensor like the parameter: DCP fills this rank's shard only.
        templates[key] = torch.empty_like(like.detach(), dtype=dtypes.get(key, like.dtype))
    try:
        dcp.load(templates, checkpoint_id=str(path))
    except dcp_errors() as exc:  # damaged or foreign shard files (CheckpointException is no Exception)
        raise ReplayError(damaged_checkpoint(path, "shard files", exc)) from None
    load_snapshot(rec, fill_sharded(snapshot, templates))
    return {"checkpoint": str(path), "sharded_tensors": len(templates), "load_s": round(time.perf_counter() - t0, 4)}


def _any(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (an all-reduce: every rank calls it)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GLOO[0])
    return bool(t.item() > 0)


_GLOO: list[Any] = [None]  # the group of the worker's own agreements: the default one (gloo for CPU tensors)


def combine(findings: list[dict[str, Any]], world: int) -> tuple[int, list[int]]:
    """``(winning rank, ranks)`` from every rank's ``{"phase", "module", "op"}`` (rank order).

    The earliest phase (data < forward < backward < optimizer), then a finding naming an op, then
    the lowest rank. ``ranks``: every rank for an optimizer fault, else the ranks whose finding is
    the winner's. ``(0, [])`` when every rank found ``none``.
    """
    live = [(_ORDER[f["phase"]], f.get("op") is None, r) for r, f in enumerate(findings) if f["phase"] in _ORDER]
    if not live:
        return 0, []
    _, _, win = min(live)
    w = findings[win]
    if w["phase"] == "optimizer":
        return win, list(range(world))
    return win, [r for r, f in enumerate(findings)
                 if (f["phase"], f.get("module"), f.get("op")) == (w["phase"], w.get("module"), w.get("op"))]


def worker(run_dir: Path, step: int | None, spec: str | None, trust: bool, capture: str | None, out: Path) -> None:
    """One rank of the relaunched replay (inside torchrun); rank 0 writes ``out/verdict.json``."""
    import torch.distributed as dist  # noqa: PLC0415

    from sentineld.contracts.capture import open_capture  # noqa: PLC0415
    from sentineld.contracts.fsdpunits import mixed_units, read_units  # noqa: PLC0415
    from sentineld.contracts.rundir import RunDir, read_run_meta  # noqa: PLC0415
    from sentineld.contracts.safeio import write_atomic  # noqa: PLC0415
    from sentineld.contracts.verdict import Finding, Replayed, make_report  # noqa: PLC0415

    from .ddp import missing_ranks_error, rank_captures  # noqa: PLC0415
    from .ddp_step import loss_tolerance  # noqa: PLC0415
    from .engine import _compiled  # noqa: PLC0415
    from .localize import localize  # noqa: PLC0415
    from .rebuild import run_step, same_loss, state_nonfinite, torch_globals  # noqa: PLC0415
    from .run_recipe import recipe_factory  # noqa: PLC0415

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = read_run_meta(run_dir)
    paths, missing, target = rank_captures(run_dir, meta.world_size, step, Path(capture) if capture else None)
    if missing:
        raise missing_ranks_error(run_dir, meta.world_size, target, paths, missing)
    named_by = [p for p in (run_dir / RunDir.RUN_JSON, *paths.values()) if p.exists()]
    make = recipe_factory(meta, spec, trust, named_by)
    flags = meta.extra.get("torch_flags") if isinstance(meta.extra.get("torch_flags"), dict) else None
    recorded = read_units(meta.extra)
    with open_capture(paths[rank]) as cap, torch_globals(meta.num_threads, flags) as in_effect:
        S = cap.snapshot_step
        held: list[Any] = [None] * world
        dist.all_gather_object(held, (S, cap.sharded_state, int(cap.steps[-1]) if cap.steps else target),
                               group=_GLOO[0])
        if len({h[:2] for h in held}) != 1:
            raise ReplayError(f"the ranks' captures name different snapshots/checkpoints {[h[:2] for h in held]}; "
                              "every rank's capture of one incident names the same DCP checkpoint")
        last = min(h[2] for h in held)  # every rank stops auto mode at the same step
        records = {int(r["step"]): r for r in cap.records() if isinstance(r, dict) and "step" in r}
        losses = {s: float(r["loss"]) for s, r in records.items() if isinstance(r.get("loss"), (int, float))}
        snapshot = cap.snapshot()

        def fresh() -> tuple[Any, dict[str, Any]]:
            rec, _mesh = _shard(make(), world, recorded)
            return rec, _load_sharded(rec, cap, snapshot)

        def rebuild(rec: Any, upto: int) -> tuple[int | None, dict[int, float]]:
            got: dict[int, float] = {}
            for s in range(S, upto):
                st = cap.step(s)
                got[s] = run_step(rec, st.batch, st.rng)
                if _any(not math.isfinite(got[s]) or state_nonfinite(rec)):
                    return s, got
            return None, got

        rec, loaded = fresh()
        broke, rebuilt = rebuild(rec, target)
        offending = target
        if broke is not None and broke < target:  # the state broke a step early: that step is the offending one
            offending = broke
            rec, loaded = fresh()
            _, rebuilt = rebuild(rec, offending)
        t1 = time.perf_counter()
        while True:
            st = cap.step(offending)
            found = localize(rec, offending, st.batch, st.rng, records.get(offending))
            rebuilt[offending] = float(found.evidence.get("replayed_loss", math.nan))
            if _any(found.phase != "none") or step is not None or offending >= last:
                break
            offending += 1
        t2 = time.perf_counter()
    devs = [abs(v - losses[s]) if math.isfinite(v) and math.isfinite(losses[s]) else (0.0 if same_loss(v, losses[s])
            else math.inf) for s, v in rebuilt.items() if s in losses]
    equal = all(same_loss(v, losses[s]) for s, v in rebuilt.items() if s in losses)
    mine = {"rank": rank, "finding": found, "equal": equal, "max_dev": max(devs, default=0.0),
            "tol": max((loss_tolerance(world, losses[s]) for s in rebuilt if s in losses), default=0.0),
            "rebuilt": {str(s): v for s, v in sorted(rebuilt.items())},
            "recorded": {str(s): losses.get(s) for s in sorted(rebuilt)}, "capture": str(paths[rank]), **loaded}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=_GLOO[0])
    if rank != 0:
        return
    findings = [e["finding"] for e in everyone]
    win, ranks = combine([{"phase": f.phase, "module": f.module, "op": f.op} for f in findings], world)
    f: Finding = findings[win]
    if f.phase == "data":
        for fld in f.evidence.get("fields", []):
            fld["rank"] = win
    equal_all = all(e["equal"] for e in everyone)
    max_dev = max(e["max_dev"] for e in everyone)
    tol = 0.0 if equal_all else max(e["tol"] for e in everyone)
    relaunched = f"relaunched at world size {world}"
    ev: dict[str, Any] = {
        "rebuilt_losses": everyone[win]["rebuilt"], "snapshot_step": S, "torch_flags": in_effect,
        "fsdp": {"state": "relaunched", "replayed_as": relaunched, "world_size": world,
                 "units": ([u.to_json() for u in recorded] if recorded else "chosen by size (not recorded)"),
                 "mixed_precision": [u.to_json() for u in mixed_units(recorded)],
                 "checkpoint": everyone[0]["checkpoint"], "sharded_tensors": everyone[0]["sharded_tensors"],
                 "load_s": max(e["load_s"] for e in everyone), "ranks_used": list(range(world)),
                 "per_rank": {str(e["rank"]): {"phase": e["finding"].phase, "module": e["finding"].module,
                                               "op": e["finding"].op, "bitwise": e["equal"]} for e in everyone},
                 "recorded_losses": {str(e["rank"]): e["recorded"] for e in everyone},
                 "rebuilt_losses": {str(e["rank"]): e["rebuilt"] for e in everyone},
                 "bitwise": equal_all, "loss_tolerance": tol,
                 "note": (f"each of {world} ranks (torchrun, gloo) loaded its own shards from the DCP checkpoint "
                          "into the recipe's model fully_shard-ed over a 1-D mesh and re-executed its own "
                          "recorded batches with FSDP's collectives; step N was traced on every rank on its "
                          "local shards")}}
    replayed = Replayed(f, requested_step=target, reproduced=equal_all or max_dev <= tol, rank=win,
                        capture=everyone[win]["capture"], max_loss_deviation=max_dev, steps_rebuilt=offending - S,
                        recorded_nonfinite=bool(f.evidence.get("recorded_nonfinite")) or any(
                            isinstance(x, float) and not math.isfinite(x)
                            for x in (e["recorded"].get(str(offending)) for e in everyone)),
                        rebuild_s=round(t1 - t0, 4), localize_s=round(t2 - t1, 4),
                        elapsed_s=round(time.perf_counter() - t0, 4), ranks=ranks, loss_tolerance=tol, evidence=ev)
    report = make_report(replayed, meta.run_id, compiled=_compiled(replayed, meta.extra), replayed_as=relaunched)
    write_atomic(out / "verdict.json", report.to_json())


def _leave(dist: Any) -> NoReturn:
    """End this rank: barrier, destroy the process group, flush stdio, exit 0 at once.

    The barrier keeps any rank from closing its gloo connections while a peer still works;
    ``os._exit`` skips the interpreter's exit-time destructors, where gloo (torch 2.13) can abort
    with "terminate called without an active exception" on a thread still joinable
    (pytorch/pytorch#179291); the verdict was written and every rank's work done before.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _main(argv: list[str]) -> int:
    """``python -m sentineld.replay.fsdp_relaunch --out DIR RUN [--step N] [--recipe S] [--capture P] [--trust]``."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m sentineld.replay.fsdp_relaunch")
    ap.add_argument("--out", required=True)
    ap.add_argument("run")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--capture", default=None)
    ap.add_argument("--trust", action="store_true")
    a = ap.parse_args(argv)
    import torch.distributed as dist  # noqa: PLC0415

    from sentineld.contracts.trust import add_replay_path, check_import_path  # noqa: PLC0415

    out = Path(a.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        add_replay_path()
        if not a.trust:
            check_import_path()
        import torch  # noqa: PLC0415

        # CPU tensors (the agreements, a CPU recipe) go through gloo; a CUDA recipe's through NCCL.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        worker(Path(a.run), a.step, a.recipe, a.trust, a.capture, out)
        _leave(dist)
    except BaseException as exc:  # every rank's failure is the launcher's message (DCP's is no Exception)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        from sentineld.contracts.dcpstate import describe_dcp_error  # noqa: PLC0415

        # DCP's CheckpointException is a BaseException whose str is every rank's traceback.
        msg = str(exc) if isinstance(exc, BadInput) else describe_dcp_error(exc)
        (out / f"error-rank{rank}.txt").write_text(msg[:4000])
        return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
