"""Train zoo cases with the real agent attached: ``python -m tests.zoo.run RUNS_DIR [CASE ...]``.

``ZOO_THREADS`` sets torch's thread count (default 1).

Run it from the repository root: the agent records the working directory in run.json, and the
replay imports ``tests.zoo.cases:make_<case>`` from there. Each case is one run directory named
after the case. Training stops three steps after the first non-finite loss, gradient or learning
rate (the agent's capture needs ``post_steps`` = 2 more); a healthy case ends with a manual capture.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sentineld.agent import attach
from sentineld.contracts.recipe import Recipe, train_step

from .cases import CASES, Case

__all__ = ["train_case", "main"]


def _manual_step(rec: Recipe, batch: Any) -> torch.Tensor:
    """The loop a user writes by hand (no zero_grad when the recipe says so)."""
    if rec.zero_grad:
        rec.optimizer.zero_grad()
    loss = rec.loss_fn(rec.model, batch)
    loss.backward()
    rec.optimizer.step()
    if rec.scheduler is not None:
        rec.scheduler.step()
    return loss.detach()


def _nonfinite(rec: Recipe, loss: torch.Tensor) -> bool:
    if not bool(torch.isfinite(loss).all()):
        return True
    lr = rec.optimizer.param_groups[0]["lr"]
    if not math.isfinite(float(lr)):
        return True
    return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in rec.model.parameters())


def train_case(case: Case, runs_dir: Path, num_threads: int = 1) -> dict[str, Any]:
    """Train ``case`` into ``runs_dir/<case.name>``; return a summary (first bad step, captures).

    Args:
        num_threads: torch threads (recorded in run.json; the replay uses the same). One thread
            keeps these tiny models fast on a shared two-core machine.
    """
    torch.set_num_threads(num_threads)
    rec = case.factory(**case.recipe_args)
    if case.prepare is not None:
        case.prepare(rec)
    watch = attach(rec.model, rec.optimizer, run_id=case.name, runs_dir=runs_dir, recipe=case.recipe,
                   recipe_args=case.recipe_args, scheduler=rec.scheduler, scaler=rec.scaler,
                   accumulation_steps=rec.accumulation_steps, metrics_port=0,
                   snapshot_every=case.snapshot_every, window=64, layer_every=0)
    torch.manual_seed(1234)  # dropout and in-model noise draw from here
    first_bad = None
    t0 = time.perf_counter()
    with watch:
        for step in range(case.steps):
            batch = case.batch(step)
            loss = _manual_step(rec, batch) if case.manual_loop else train_step(rec, batch)
            watch.step(loss, batch)
            if first_bad is None and _nonfinite(rec, loss):
                first_bad = step
            if first_bad is not None and step >= first_bad + 3:
                break
        if case.expect.phase == "none":
            watch.capture_now("manual", "healthy run: replay a finite step")
    return {"case": case.name, "first_bad_step": first_bad, "steps": step + 1,
            "captures": [p.name for p in watch.captures], "train_s": round(time.perf_counter() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    """Train the named cases (default: the whole zoo, not the bench-only ones); print JSON lines."""
    from .cases import ZOO  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    runs_dir = Path(argv[0])
    names = argv[1:] or [c.name for c in ZOO]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {sorted(CASES)}", file=sys.stderr)
        return 2
    runs_dir.mkdir(parents=True, exist_ok=True)
    threads = int(os.environ.get("ZOO_THREADS", "1"))
    for name in names:
        print(json.dumps(train_case(CASES[name], runs_dir, threads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
