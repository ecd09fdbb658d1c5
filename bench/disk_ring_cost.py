"""Per-step cost of the on-disk ring (``disk_ring=True``): step time against a bare loop, and
against the agent with its ring in RAM only, same process, same data.

Method (as ``bench/overhead.py``): three identical models (same init): bare, agent, agent with
the on-disk ring. Blocks of ``--block`` steps rotate between them (the order shifts every block)
so drift in machine speed hits all alike. Per block we take the median step wall time and the
process CPU time per step; the figure is the median over blocks of the per-block ratio to bare,
with the 10th-90th percentile. The disk ring writes on a background thread, so its cost shows
up as CPU time (HDF5 serialisation, holding the GIL) more than as wall time on an idle core; on
a machine whose cores are all busy, the CPU ratio is the figure to read.

Also printed: items (steps and snapshots) the ring wrote per step, and the ring's size and file
count on disk at the end (bounded: two snapshots and ``window`` steps, plus the steps sharing a
segment file with them: steps are appended to segments of K records, ``sentineld.agent.diskring``).

Run: ``python bench/disk_ring_cost.py [--blocks 20] [--block 20] [--models mlp,transformer]``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import mlp, run_block, transformer  # noqa: E402


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure(name: str, build: Callable[[], Any], blocks: int, block: int) -> dict[str, Any]:
    from sentineld.agent import attach

    torch.manual_seed(0)
    bare, make_batch = build()
    ram, disk = copy.deepcopy(bare), copy.deepcopy(bare)
    opts = {k: torch.optim.Adam(m.parameters(), 1e-4) for k, m in (("bare", bare), ("ram", ram), ("disk", disk))}
    runs = Path(tempfile.mkdtemp(prefix="sentineld-bench-"))
    watches = {"bare": None,
               "ram": attach(ram, opts["ram"], run_id=f"ram-{name}", runs_dir=runs, metrics_port=0),
               "disk": attach(disk, opts["disk"], run_id=f"disk-{name}", runs_dir=runs, metrics_port=0,
                              disk_ring=True)}
    models = {"bare": bare, "ram": ram, "disk": disk}
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(block)]
    for k in models:  # warm-up
        run_block(models[k], opts[k], batches, watches[k])
    ring = next((runs / f"disk-{name}").glob("ring-*"))
    writer = watches["disk"]._rec.disk
    written0 = writer.written
    wall = {"ram": [], "disk": []}
    cpu = {"ram": [], "disk": []}
    bare_ms = []
    steps = 0
    for i in range(blocks):
        order = ["bare", "ram", "disk"]
        order = order[i % 3:] + order[:i % 3]
        res = {k: run_block(models[k], opts[k], batches, watches[k]) for k in order}
        for k in ("ram", "disk"):
            wall[k].append(res[k][0] / res["bare"][0])
            cpu[k].append(res[k][1] / res["bare"][1])
        bare_ms.append(1e3 * res["bare"][0])
        steps += block
    writer.flush()
    on_disk = _dir_bytes(ring)
    ring_files = sum(1 for p in ring.iterdir() if p.suffix == ".ring")
    files = writer.written - written0
    dropped = writer.dropped
    for w in watches.values():
        if w is not None:
            w.close()
    shutil.rmtree(runs, ignore_errors=True)

    def q(xs: list[float]) -> tuple[float, float, float]:
        dec = statistics.quantiles(xs, n=10)
        return statistics.median(xs), dec[0], dec[-1]

    return {"model": name, "params": sum(p.numel() for p in bare.parameters()),
            "bare_ms": statistics.median(bare_ms), "ram_wall": q(wall["ram"]), "disk_wall": q(wall["disk"]),
            "ram_cpu": statistics.median(cpu["ram"]), "disk_cpu": statistics.median(cpu["disk"]),
            "items_per_step": files / steps, "ring_mb": on_disk / 2**20, "ring_files": ring_files,
            "dropped": dropped,
            "K": watches["disk"].snapshot_every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--models", default="mlp,transformer")
    args = ap.parse_args()
    builders = {"mlp": mlp, "transformer": transformer}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, blocks={args.blocks} x {args.block} steps; "
          "ratios are step time / bare step time (median, p10-p90 over blocks)")
    print(f"{'model':<12}{'params':>10}{'bare ms':>9}{'RAM ring':>10}{'disk ring':>11}{'p10':>7}{'p90':>7}"
          f"{'cpu RAM':>9}{'cpu disk':>10}{'items/step':>11}{'ring MiB':>10}{'files':>6}{'dropped':>8}{'K':>5}")
    for name in args.models.split(","):
        r = measure(name, builders[name], args.blocks, args.block)
        print(f"{r['model']:<12}{r['params']:>10}{r['bare_ms']:>9.2f}{r['ram_wall'][0]:>10.3f}"
              f"{r['disk_wall'][0]:>11.3f}{r['disk_wall'][1]:>7.3f}{r['disk_wall'][2]:>7.3f}"
              f"{r['ram_cpu']:>9.3f}{r['disk_cpu']:>10.3f}{r['items_per_step']:>11.2f}{r['ring_mb']:>10.1f}"
              f"{r['ring_files']:>6}"
              f"{r['dropped']:>8}{r['K']:>5}")


if __name__ == "__main__":
    main()
