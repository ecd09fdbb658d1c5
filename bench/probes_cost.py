"""Cost of the per-layer probes (sentineld.agent.probes): step time with probes at every=1, 10, 50
against a bare loop, same process, same data.

Method: one model per configuration (same init), an MLP on sklearn's digits (64 -> 256 -> 256 ->
10, ReLU, batch 64, Adam). Blocks of ``--block`` steps rotate through the configurations, the
order shifted by one each round, so drift in machine speed hits all alike. The figure per
configuration is the median step wall time over all its steps, and the median over rounds of the
per-round ratio to the bare loop. Single-threaded torch (as the signature tests run).

Run: ``python bench/probes_cost.py [--rounds 30] [--block 20]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent.probes import attach_probes


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(d.target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, y = digits()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))
    configs: list[int | None] = [None, 1, 10, 50]
    runs: list[dict[str, Any]] = []
    for every in configs:
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        probes = attach_probes(model, opt, every=every) if every else None
        runs.append({"every": every, "model": model, "opt": opt, "probes": probes, "step": 0,
                     "times": [], "round_medians": [], "g": torch.Generator().manual_seed(0)})

    def one_step(run: dict[str, Any]) -> float:
        idx = torch.randint(0, x.shape[0], (64,), generator=run["g"])
        t0 = time.perf_counter()
        if run["probes"]:
            run["probes"].begin_step(run["step"])
        run["opt"].zero_grad()
        F.cross_entropy(run["model"](x[idx]), y[idx]).backward()
        run["opt"].step()
        if run["probes"]:
            run["probes"].collect()
        run["step"] += 1
        return time.perf_counter() - t0

    for run in runs:                       # warm-up
        for _ in range(args.block):
            one_step(run)
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
        for run in order:
            ts = [one_step(run) for _ in range(args.block)]
            run["times"].extend(ts)
            run["round_medians"].append(statistics.median(ts))
    bare = runs[0]
    print(f"MLP 64-256-256-10 on digits, batch 64, Adam, {args.threads} thread(s); "
          f"{args.rounds} rounds x {args.block} steps per configuration")
    print(f"{'probes':>12s} {'median step':>12s} {'ratio to bare':>14s} {'p10-p90 ratio':>16s}")
    for run in runs:
        ratios = sorted(a / b for a, b in zip(run["round_medians"], bare["round_medians"]))
        p10, p90 = ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]
        label = "bare" if run["every"] is None else f"every={run['every']}"
        print(f"{label:>12s} {statistics.median(run['times']) * 1e3:9.3f} ms "
              f"{statistics.median(ratios):13.3f}x {p10:7.3f}-{p90:.3f}x")
    for run in runs:
        if run["probes"]:
            run["probes"].remove()


if __name__ == "__main__":
    main()
