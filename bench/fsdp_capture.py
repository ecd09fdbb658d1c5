"""FSDP2 figures (issue 24): capture time and size vs parameters, and the consolidated replay time.

Usage (the script starts torchrun itself)::

    python bench/fsdp_capture.py [--world 2] [--widths 512,1024,2048] [--out DIR]

For each width d, a 4-layer MLP of ``Linear(d, d)`` (4 (d^2 + d) parameters), every Linear its
own FSDP unit, Adam, is trained on W gloo ranks with the agent attached; a NaN is planted in
rank 1's batch at step 6, so every rank writes its capture and its shard of one DCP checkpoint.
Printed per width: parameters, capture wall time (incident to capture on disk, rank 0's
writer thread: DCP save + HDF5), DCP bytes, HDF5 bytes per rank, the consolidated replay's
wall time (``sentineld replay RUN``, one process) and the relaunched one's (``sentineld replay
RUN --world-size W``: torchrun, W ranks), with whether both verdicts agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT_STEP, STEPS = 6, 9


def make_recipe(width: int = 128):  # noqa: ANN201 - the bench's recipe
    import torch

    from sentineld.contracts.recipe import Recipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                  loss_fn=lambda m, b: m(b[0]).pow(2).mean())


def _worker(runs: str, width: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sentineld.agent import attach

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = make_recipe(width)
    mesh = init_device_mesh("cpu", (world,))
    for layer in rec.model:
        fully_shard(layer, mesh=mesh)
    fully_shard(rec.model, mesh=mesh)
    opt = torch.optim.Adam(rec.model.parameters(), lr=1e-3)
    watch = attach(rec.model, opt, run_id=f"w{width}", runs_dir=runs, metrics_port=0, snapshot_every=4,
                   layer_every=0, recipe="bench.fsdp_capture:make_recipe", recipe_args={"width": width})
    t_inc = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(32, width, generator=g)
        if rank == 1 and step == FAULT_STEP:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = rec.loss_fn(rec.model, (x,))
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x,))
        if step == FAULT_STEP:
            t_inc = time.perf_counter()
    t0 = time.perf_counter()
    watch.close()
    if rank == 0:
        print(json.dumps({"close_s": time.perf_counter() - t0, "after_incident_s": time.perf_counter() - t_inc}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--widths", default="512,1024,2048")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker[0], int(a.worker[1]))
        return
    runs = Path(a.out or tempfile.mkdtemp(prefix="fsdp-bench-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    print("params  world  capture_s  dcp_bytes  h5_bytes_per_rank  replay_s  replay_rebuild_s  relaunch_s")
    for width in (int(w) for w in a.widths.split(",")):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(a.world), __file__, "--worker", str(runs), str(width)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(out.stderr[-3000:])
        timing = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
        run = runs / f"w{width}"
        dcp = next(run.glob("capture-step*.dcp"))
        dcp_bytes = sum(p.stat().st_size for p in dcp.iterdir())
        h5 = [p.stat().st_size for p in run.glob("capture-rank*.h5")]
        runs_of = {}
        for how, extra in (("consolidated", []), ("relaunched", ["--world-size", str(a.world)])):
            t0 = time.perf_counter()
            rep = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run), "--json", *extra], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=600)
            runs_of[how] = (time.perf_counter() - t0, json.loads(rep.stdout))
        (replay_s, verdict), (relaunch_s, relaunched) = runs_of["consolidated"], runs_of["relaunched"]
        same = all(verdict[k] == relaunched[k] for k in ("phase", "module", "op", "step", "ranks", "reproduced"))
        params = 4 * (width * width + width)
        print(f"{params:>8} {a.world:>5} {timing['after_incident_s']:>10.3f} {dcp_bytes:>10} "
              f"{sum(h5) // len(h5):>18} {replay_s:>9.2f} {verdict['rebuild_s']:>8.2f} {relaunch_s:>11.2f}  "
              f"phase={verdict['phase']} reproduced={verdict['reproduced']} relaunched_same={same} "
              f"({relaunched['replayed_as']})")


if __name__ == "__main__":
    main()
