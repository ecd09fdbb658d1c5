"""Planted faults for the counterfactual engine (spike, what-if, reproducibility), each with the
right answer known from how it is planted. Recipes are named ``tests.replay.spikecases:make_<x>``
(the tests train with the repository root as working directory).

Spikes (a finite loss jump):

- ``data``: step ``AT``'s batch has samples :data:`BAD_SAMPLES` negated and scaled x20;
- ``lr_jump``: a LambdaLR whose factor is 50 at step ``AT`` only (SGD): the update of step AT
  jumps, the loss of step AT+1 spikes on any batch (cause state, quantity lr);
- ``adam_module``: an Adam whose second moment ``exp_avg_sq`` of module ``body`` collapses to 0
  at optimizer step ``AT``, a step whose body gradient is small (x1e-2): Adam's normalized step
  m / sqrt(v) of body jumps ~1000x (Molybog et al.'s instability: a second moment ~0 against the
  first); cause state, module body, quantity second moment.

- ``interaction``: feature 0 is 0 in every batch but step ``AT``'s, and an SGD whose step
  ``AT - 1`` scales body's weights of feature 0 x100 (they had no gradient to say otherwise):
  batch AT spikes on the state before AT only; the state before AT is fine on other batches, and
  batch AT on the state before AT-1: cause interaction.

Non-finite faults (what-if / reproducibility):

- ``log_zero``: ``log(sigmoid(z))`` in the model, whose sigmoid is exactly 0 for the batch of
  step ``AT`` (inputs x1e5 there: 0 in float64 too): log(0) (an eps / clamp / logsigmoid fix;
  software);
- ``log_zero_nll``: a hand-written NLL in the loss function, ``-log(softmax(z).gather(1, y))``,
  with the inputs of step ``AT`` x1e5 as for ``log_zero``: the label's probability underflows to
  exactly 0 for some rows, log(0) outside the model (its stable rewrite is ``log_softmax``
  through the gather);
- ``lr_high``: SGD at lr 10 from step ``AT`` (a schedule factor x100): the loss overflows within a
  few steps (lr x0.1 or clipping keeps it finite);
- ``transient``: a module that corrupts its output only in the training process, from a source
  outside the capture (a module-level flag the replay never sets): transient;
- ``fp16_overflow``: float16 parameters and a hand-written softmax (``exp(z) / sum exp(z)``)
  whose ``exp`` passes 65504 for the logits of step ``AT`` (inputs x20 there): inf / inf = NaN
  in float16, finite in float32: precision.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe

AT = 40
BAD_SAMPLES = (5, 17, 22)
BATCH = 32
FEATURES = 16
CLASSES = 4

#: lr factor of the ``lr_high`` case from step AT on.
LR_HIGH = 100.0

#: Set only by the training loop of the ``transient`` case (never in a replay process).
CORRUPT_IN_TRAINING = {"on": False}


class Net(nn.Module):
    """body -> relu -> head."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class LogSigmoidHead(nn.Module):
    """A binary-style head written as log(sigmoid(.)): -inf once sigmoid underflows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.head(torch.relu(self.body(x)))))


class Flaky(nn.Module):
    """Net whose body output is corrupted while :data:`CORRUPT_IN_TRAINING` is on (training only)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if CORRUPT_IN_TRAINING["on"]:
            h = h * float("inf")  # a bit flip in the training process's memory, say
        return self.head(torch.relu(h))


class ExpSoftmaxNet(Net):
    """Net whose output is log(exp(z) / sum(exp(z))): exp overflows float16 at z > 11."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(super().forward(x))
        return torch.log(e / e.sum(-1, keepdim=True))


class GlitchAdam(torch.optim.Adam):
    """Adam whose ``exp_avg_sq`` of the param groups flagged ``glitch`` collapses at step AT (and
    their gradient is small that step, so the new squared gradient does not refill it)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for g in self.param_groups:
            if not g.get("glitch"):
                continue
            for p in g["params"]:
                st = self.state.get(p)
                if st and int(st["step"]) == AT and p.grad is not None:  # optimizer step AT (0-based)
                    st["exp_avg_sq"].zero_()
                    p.grad.mul_(1e-2)
        return super().step(closure)


class ColumnGlitchSGD(torch.optim.SGD):
    """SGD whose optimizer step AT-1 (0-based) scales column 0 of its glitch group's first
    parameter x100 (the step count lives in the param group, so it is in the snapshot)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        for g in self.param_groups:
            g["n"] = int(g.get("n", 0)) + 1
            if g.get("glitch") and g["n"] == AT:
                with torch.no_grad():
                    g["params"][0][:, 0] *= 100.0
        return out


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.nll_loss(model(x), y)


def picked_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy by hand: the label's softmax probability, then its log."""
    x, y = batch
    p = torch.softmax(model(x), dim=-1)
    return -torch.log(p.gather(1, y[:, None]).squeeze(1)).mean()


def make_data() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    return Recipe(model=m, optimizer=torch.optim.Adam(m.parameters(), 1e-2), loss_fn=ce)


def make_lr_jump() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 50.0 if s == AT else 1.0)
    return Recipe(model=m, optimizer=opt, loss_fn=ce, scheduler=sched)


def make_adam_module() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    opt = GlitchAdam([{"params": m.body.parameters(), "glitch": True}, {"params": m.head.parameters()}], lr=1e-3)
    return Recipe(model=m, optimizer=opt, loss_fn=ce)


def make_interaction() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    opt = ColumnGlitchSGD([{"params": [m.body.weight], "glitch": True},
                           {"params": [m.body.bias, *m.head.parameters()]}], lr=0.05)
    return Recipe(model=m, optimizer=opt, loss_fn=ce)


def make_log_zero() -> Recipe:
    torch.manual_seed(0)
    m = LogSigmoidHead()
    return Recipe(model=m, optimizer=torch.optim.Adam(m.parameters(), 1e-3), loss_fn=nll)


def make_log_zero_nll() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    return Recipe(model=m, optimizer=torch.optim.Adam(m.parameters(), 1e-3), loss_fn=picked_nll)


def make_lr_high() -> Recipe:
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: LR_HIGH if s >= AT else 1.0)
    return Recipe(model=m, optimizer=opt, loss_fn=ce, scheduler=sched)


def make_transient() -> Recipe:
    torch.manual_seed(0)
    m = Flaky()
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), 0.05), loss_fn=ce)


def make_fp16_overflow() -> Recipe:
    torch.manual_seed(0)
    m = ExpSoftmaxNet().half()
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), 0.01), loss_fn=nll)


CASES = {"data": make_data, "lr_jump": make_lr_jump, "adam_module": make_adam_module,
         "interaction": make_interaction,
         "log_zero": make_log_zero, "log_zero_nll": make_log_zero_nll, "lr_high": make_lr_high, "transient": make_transient,
         "fp16_overflow": make_fp16_overflow}


def batch_of(case: str, step: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: 4 Gaussian clusters, with the case's plant at step :data:`AT`."""
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    centers = torch.linspace(-2, 2, CLASSES).unsqueeze(1).repeat(1, FEATURES)
    x = centers[y] + torch.randn(BATCH, FEATURES, generator=g)
    if case == "interaction":
        x[:, 0] = 2.0 if step == AT else 0.0
    if step == AT and case == "data":
        x[list(BAD_SAMPLES)] *= -20.0
    if step == AT and case in ("log_zero", "log_zero_nll"):
        x = x * 1e5
    if step == AT and case == "fp16_overflow":
        x = x * 20.0
    if case == "fp16_overflow":
        x = x.half()
    return x, y


def train(case: str, runs_dir: Any, steps: int = AT + 12, run_id: str | None = None, **agent: Any) -> Any:
    """Train ``case`` with the agent attached (recipe named for the replay); returns the run dir."""
    from sentineld.agent import attach  # noqa: PLC0415
    from sentineld.contracts.recipe import train_step  # noqa: PLC0415

    rec = CASES[case]()
    cfg = {"metrics_port": 0, "snapshot_every": 4, "layer_every": 0, **agent}
    watch = attach(rec.model, rec.optimizer, run_id=run_id or f"cf-{case}", runs_dir=runs_dir,
                   recipe=f"tests.replay.spikecases:make_{case}", scheduler=rec.scheduler, **cfg)
    g = torch.Generator().manual_seed(1)
    try:
        with watch:
            for s in range(steps):
                batch = batch_of(case, s, g)
                CORRUPT_IN_TRAINING["on"] = case == "transient" and s == AT
                watch.step(train_step(rec, batch), batch)
    finally:
        CORRUPT_IN_TRAINING["on"] = False
    return watch.run_dir


def figures() -> None:
    """Print replay / what-if / reproducibility times per planted case (docs/whatif.md).

    ``python -m tests.replay.spikecases`` from the repository root.
    """
    import json  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    import time  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from sentineld.contracts.rundir import list_captures  # noqa: PLC0415
    from sentineld.replay.engine import replay_run  # noqa: PLC0415

    global LR_HIGH
    LR_HIGH = 60.0
    plans = {"lr_high": {"steps": AT + 30, "snapshot_every": 16, "spike_captures": 0}}
    for case in CASES:
        run = train(case, Path(tempfile.mkdtemp()), **plans.get(case, {}))
        cap = list_captures(run)[0][3]
        t = time.perf_counter()
        replay_run(run, capture=cap)
        t0 = time.perf_counter() - t
        t = time.perf_counter()
        r = json.loads(replay_run(run, capture=cap, what_if=True).to_json())
        t1 = time.perf_counter() - t
        wi = r["evidence"]["what_if"]
        print(f"{case:14s} replay {t0:.3f} s, with what-if {t1:.3f} s, {len(r['what_if'])} candidates "
              f"{wi['per_candidate_s']:.4f} s each, {wi['total_s']:.3f} s total, reproducibility "
              f"{r['reproducibility']['wall_s']:.3f} s ({r['reproducibility']['class']}), cause {r['cause_class']}")


if __name__ == "__main__":
    figures()
