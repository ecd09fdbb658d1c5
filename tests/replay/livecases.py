"""Plain training loops with a planted fault for the in-process localization tests.

Each loop is what a user writes (zero_grad, forward, loss, backward, optimizer step) with one line
added: ``attach(model, optimizer, loss_fn=...)`` (or neither ``loss_fn`` nor a recipe). Run as a
script (``python -m tests.replay.livecases RUNS RUN_ID FAULT STEPS [MODE]``) it trains one loop,
closes the agent and prints one JSON summary line; the tests import :func:`train` directly.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from sentineld.agent import attach

#: The step where each fault shows (the data fault plants NaN into that step's batch).
FAULT_STEP = 12


class LogFeatures(nn.Module):
    """log of its input: the planted forward fault makes a zero reach it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Net(nn.Module):
    def __init__(self, fault: str = "none", hidden: int = 16) -> None:  # replayable without a recipe
        super().__init__()
        self.fault = fault
        self.fc1 = nn.Linear(8, hidden)
        self.mid = nn.Linear(hidden, hidden) if hidden > 16 else nn.Identity()  # the bench's bigger model
        self.drop = nn.Dropout(0.25)
        self.feats = LogFeatures()
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.mid(torch.relu(self.fc1(x)))))
        # softplus > 0, except the forward fault's batch: column 0 of x is -1000 there -> log(0).
        return self.fc2(self.feats(F.softplus(h + x[:, :1].clamp(max=0))))


class RatioSGD(torch.optim.Optimizer):
    """Steps each parameter by its gradient over the gradient's norm: 0/0 when the gradient is 0."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / p.grad.norm())


def make_batch(step: int, fault: str, gen: torch.Generator, fault_step: int = FAULT_STEP) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(6, 8, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    if step == fault_step:
        if fault == "data":
            x[2, 5] = float("nan")
        elif fault in ("forward", "forward_only"):
            x[:, 0] = -1000.0
    return x, y


def loss_for(fault: str) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        loss = F.cross_entropy(out, y)
        if fault == "loss" and bool((x[:, 1] > 100).any()):
            loss = loss + torch.log(torch.zeros(()))  # -inf: the loss itself goes non-finite
        if fault == "optimizer" and bool((x[:, 1] > 100).any()):
            loss = loss * 0.0  # every gradient 0: RatioSGD divides 0 by 0
        if fault == "backward" and bool((x[:, 1] > 100).any()):
            # sqrt at 0: finite forward (0), infinite gradient in backward.
            loss = loss + torch.sqrt((out - out.detach()).pow(2).sum())
        return loss
    return loss_fn


def train(runs_dir: Path, run_id: str, fault: str, steps: int = 24, localize: str = "thread",
          seed: int = 0, step_sleep_s: float = 0.0, no_loss_fn: bool = False,
          until_verdict: bool = False, fault_step: int = FAULT_STEP, hidden: int = 16) -> dict[str, Any]:
    """Train one loop; returns ``{"watch", "model", "optimizer", "nan_time_s", "step_s", ...}``.

    ``until_verdict``: go on past ``steps`` until the verdict file exists (at most 2000 steps), so
    the localization surely ran while training did; ``steps_run`` says how many ran.
    """
    from sentineld.contracts.verdict_file import verdict_path
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = Net(fault, hidden)
    opt = RatioSGD(model.parameters()) if fault == "optimizer" else torch.optim.Adam(model.parameters(), lr=1e-2)
    # The lr fault: the scheduler sets an infinite learning rate for step FAULT_STEP.
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.inf if s == fault_step else 1.0)
             if fault == "lr" else None)
    loss_fn = loss_for(fault)
    kwargs: dict[str, Any] = {} if fault == "forward_only" or no_loss_fn else {"loss_fn": loss_fn}
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=0, localize=localize,
                   snapshot_every=5, scheduler=sched, **kwargs)
    nan_time = None
    step_s: list[float] = []
    step = 0
    verdict_seen_at = None
    while step < steps or (until_verdict and verdict_seen_at is None and step < 2000):
        if until_verdict and verdict_seen_at is None and watch.captures and verdict_path(watch.captures[0]).exists():
            verdict_seen_at = step
        t0 = time.perf_counter()
        x, y = make_batch(step, fault, gen, fault_step)
        if step == fault_step and fault in ("loss", "backward", "optimizer"):
            x[:, 1] = 1000.0
        opt.zero_grad()
        loss = loss_fn(model, (x, y))
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        watch.step(loss, (x, y))
        if step_sleep_s:
            time.sleep(step_sleep_s)
        if step == fault_step:
            nan_time = time.time()
        step_s.append(time.perf_counter() - t0)
        step += 1
    watch.close()
    return {"watch": watch, "model": model, "optimizer": opt, "nan_time_s": nan_time, "step_s": step_s,
            "rng_after": torch.get_rng_state(), "steps_run": step, "verdict_seen_at": verdict_seen_at}


def main() -> None:
    runs, run_id, fault, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "thread"
    out = train(runs, run_id, fault, steps, localize=mode)
    print(json.dumps({"run_id": out["watch"].run_id, "nan_time_s": out["nan_time_s"],
                      "memory_bytes": getattr(out["watch"]._live, "memory_bytes", None)}))


if __name__ == "__main__":
    main()
