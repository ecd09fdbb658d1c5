"""Per-step cost of the on-disk ring's writer thread, measured on its own: ``DiskRingWriter._write_step``
(what the writer thread runs for each step: pack, JSON, write, rotate, prune) called directly on
this thread for an MLP batch (128x64 float32 + 128 int64 labels) with the CPU RNG state and a step
record, as ``bench/disk_ring_cost.py``'s MLP gives it. CPU is this thread's ``thread_time``, wall
its ``perf_counter``, per step, after a warm-up longer than the window (pruning at steady state).
The same command measures any writer that has ``_write_step(entry, event)`` (the file-per-step
one before issue 23, the segments after).

Run: ``python bench/ringmicro.py [--steps 2000] [--window 256]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.ringformat import Packer
from sentineld.contracts.rng import capture_rng, rng_to_json


def _per_call_us(f: Callable[[int], Any], n: int = 2000) -> float:
    t0 = time.thread_time()
    for i in range(n):
        f(i)
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="sentineld-ringmicro-"))
    w = DiskRingWriter(run, rank=0, window=args.window, run_id="micro", torch_version=torch.__version__)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    rng = capture_rng()
    rec = {"kind": "step", "step": 1, "loss": 2.3, "grad_norm": 1.2, "lr": 1e-3, "step_s": 0.006,
           "time_s": 123.4, "extra": {"a": 1, "b": 2}}

    def one(n: int) -> None:
        w._write_step(SimpleNamespace(step=n, batch=(x, y), rng=rng, record=dict(rec, step=n)), None)

    warm = args.window + 64
    for n in range(warm):
        one(n)
    t0, w0 = time.thread_time(), time.perf_counter()
    for n in range(warm, warm + args.steps):
        one(n)
    cpu, wall = (time.thread_time() - t0) / args.steps * 1e6, (time.perf_counter() - w0) / args.steps * 1e6
    files = sorted(p.name for p in w.dir.iterdir())
    size = sum(p.stat().st_size for p in w.dir.iterdir())
    print(f"writer per step ({args.steps} steps, window {args.window}): cpu {cpu:.1f} us, wall {wall:.1f} us; "
          f"on disk at the end: {len(files)} files, {size / 2**20:.1f} MiB, failures {w.failures}")
    header = {"kind": "step", "step": 1, "record": rec, "batch": Packer().tree((x, y))}
    print("parts (us, CPU): Packer.tree %.1f, rng_to_json %.1f, json.dumps %.1f" % (
        _per_call_us(lambda i: Packer().tree((x, y))), _per_call_us(lambda i: rng_to_json(dict(rng))),
        _per_call_us(lambda i: json.dumps(header, allow_nan=True))))
    w.close()
    shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
