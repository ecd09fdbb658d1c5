"""What one sampled step of the layer probes costs, by kind: full, activations-only, none.

Method: the agent at its defaults (localizer off) on one of bench/overhead.py's models, 40
steps first, then ``--reps`` rounds of three steps, one of each kind, the kind forced by
replacing ``probes.sampled_at`` / ``probes.full_at`` for the step; each step's training-thread
CPU time (``time.thread_time``: what the step itself used, whatever else the machine runs);
medians printed, and each kind minus the unsampled step.

Run: ``python bench/sample_cost.py [--model mlp|cnn|transformer] [--reps 60]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402

import sentineld.agent.probes as probes_mod  # noqa: E402
from sentineld.agent import attach  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="mlp")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, make = {"mlp": overhead.mlp, "cnn": overhead.cnn, "transformer": overhead.transformer}[args.model]()
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    x, y = make(torch.Generator().manual_seed(0))
    watch = attach(model, opt, run_id=f"sample-cost-{time.time_ns()}", runs_dir=tempfile.mkdtemp(),
                   metrics_port=0, localize="off", capture_on_sigterm=False)

    def step() -> float:
        t0 = time.thread_time()
        opt.zero_grad()
        loss = overhead.loss_of(model, x, y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
        return time.thread_time() - t0

    for _ in range(40):
        step()
    res: dict[str, list[float]] = {"none": [], "activations": [], "full": []}
    real = probes_mod.sampled_at, probes_mod.full_at
    try:
        for _ in range(args.reps):
            for kind in res:
                probes_mod.sampled_at = lambda *a, k=kind, **kw: k != "none"  # type: ignore[assignment]
                probes_mod.full_at = lambda *a, k=kind, **kw: k == "full"  # type: ignore[assignment]
                res[kind].append(step())
    finally:
        probes_mod.sampled_at, probes_mod.full_at = real
        watch.close()
    med = {k: 1e3 * statistics.median(v) for k, v in res.items()}
    load = os.getloadavg()[0]
    print(f"{args.model}: step without a sample {med['none']:.2f} ms thread CPU (load {load:.1f}); "
          f"activations-only +{med['activations'] - med['none']:.2f} ms; full +{med['full'] - med['none']:.2f} ms")


if __name__ == "__main__":
    main()
