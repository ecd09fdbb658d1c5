"""Agent overhead on a torch.compile'd model vs the compiled bare loop (issue 24).

Usage: python bench/compiled_overhead.py [--backend aot_eager|inductor] [--steps 60]

The DDP tests' model (tests/e2e/ddp_model.py), compiled. It prints the median step time past the
first (compile) step, bare and with the agent attached, and dynamo's graph-break and graph counts
for each (the attached loop must match the bare one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(backend: str, steps: int, agent: bool) -> tuple[float, int, int]:
    import torch
    from torch._dynamo.utils import counters

    from sentineld.agent import attach
    from tests.e2e.ddp_model import batch_for, loss_fn, make_recipe

    torch._dynamo.reset()
    counters.clear()
    rec = make_recipe()
    model, opt = torch.compile(rec.model, backend=backend), rec.optimizer
    watch = attach(model, opt, run_id="bench", runs_dir=tempfile.mkdtemp(), metrics_port=0,
                   recipe="tests.e2e.ddp_model:make_recipe") if agent else None
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = batch_for(0, step, None, 0, 0)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=batch)
        times.append(time.perf_counter() - t0)
    if watch is not None:
        watch.close()
    return statistics.median(times[1:]), sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    for agent in (False, True):
        med, breaks, graphs = run(a.backend, a.steps, agent)
        print(f"{a.backend} {'agent' if agent else 'bare '}: median step {med * 1e3:.2f} ms, "
              f"graph breaks {breaks}, graphs {graphs}")


if __name__ == "__main__":
    main()
