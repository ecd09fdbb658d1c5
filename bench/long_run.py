"""The agent's cost is flat in the number of steps: a tiny model trained ``--steps`` steps (100k by
default) with the agent attached at its defaults, against a bare copy, same process.

Method: chunks of ``--chunk`` steps alternate between the bare and the watched loop (same data,
same init); per window of ``--window`` steps we print the agent's added microseconds per step
(median over the window's chunks of watched minus bare mean step time), the ratio, the process's
resident memory and the ring's bytes. Growth would show as a rising added time or RSS from the
first window to the last; the last line compares the first and the last window.

Run: ``python bench/long_run.py [--steps 100000] [--window 10000] [--chunk 500]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def chunk(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any], watch: Any) -> float:
    """Mean wall seconds per step over ``batches``."""
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=(x, y))
    return (time.perf_counter() - t0) / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=10_000)
    ap.add_argument("--chunk", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from sentineld.agent import attach

    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    watched = copy.deepcopy(bare)
    ob, ow = torch.optim.Adam(bare.parameters(), 1e-3), torch.optim.Adam(watched.parameters(), 1e-3)
    w = attach(watched, ow, run_id="long", runs_dir=tempfile.mkdtemp(prefix="sentineld-long-"), metrics_port=-1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(args.chunk)]
    print(f"tiny MLP {sum(p.numel() for p in bare.parameters())} params, Adam; {args.steps} watched steps, "
          f"windows of {args.window}, chunks of {args.chunk}")
    print("| steps | bare us/step | added us/step | ratio | RSS MiB | ring entries | ring batch bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    done, rows = 0, []
    while done < args.steps:
        added, bare_us, ratios = [], [], []
        for i in range(args.window // args.chunk):
            order = [(bare, ob, None), (watched, ow, w)] if i % 2 == 0 else [(watched, ow, w), (bare, ob, None)]
            res = {id(m): chunk(m, o, batches, wa) for m, o, wa in order}
            b, a = res[id(bare)], res[id(watched)]
            added.append((a - b) * 1e6)
            bare_us.append(b * 1e6)
            ratios.append(a / b)
        done += args.window
        row = (done, statistics.median(bare_us), statistics.median(added), statistics.median(ratios), rss_mib(),
               len(w._ring.entries), w._ring.nbytes)
        rows.append(row)
        print(f"| {row[0]} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.3f} | {row[4]:.0f} | {row[5]} | {row[6]} |",
              flush=True)
    w.close()
    first, last = rows[0], rows[-1]
    # The ratio, not the added microseconds, is the figure to compare: on a shared machine both
    # loops slow down together when the load rises, and the added time with them.
    print(f"first -> last window: ratio {first[3]:.3f} -> {last[3]:.3f}, added {first[2]:.0f} -> {last[2]:.0f} "
          f"us/step, RSS {first[4]:.0f} -> {last[4]:.0f} MiB; stream lines dropped: {w.stream.dropped_lines}")


if __name__ == "__main__":
    main()
