"""Models and optimizers of every legitimate kind: training bitwise unchanged, agent still working,
incident captured and replayable."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.replay import replay_run

from .conftest import problems, stream

_ids = itertools.count()


# --------------------------------------------------------------- bitwise guards (pass today)
def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2))


def _std(m, opt, extra, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss


def _lbfgs(m, opt, extra, x, y):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss
    return opt.step(closure)


def _scaler(m, opt, extra, x, y):
    sc = extra["scaler"]
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(m(x), y)
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    return loss


def _two_opts(m, opt, extra, x, y):
    opt.zero_grad()
    extra["opt2"].zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    extra["opt2"].step()
    return loss


def _tied():
    e = nn.Embedding(10, 4)
    lin = nn.Linear(4, 2)
    head = nn.Linear(4, 10, bias=False)
    head.weight = e.weight

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.lin, self.head = e, lin, head

        def forward(self, x):
            return self.lin(self.e(x.abs().long().clamp(max=9)[:, 0]) + self.head(self.e(x.abs().long().clamp(max=9)[:, 1]))[:, :4])
    return M()


def _branchy():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.n = nn.Linear(4, 2), nn.Linear(4, 2), 0

        def forward(self, x):
            self.n += 1
            return self.a(x) if self.n % 2 else self.b(x)   # b gets no grad on odd steps
    return M()


CASES = {
    "params_without_grad_some_steps": (_branchy, lambda m: torch.optim.AdamW(m.parameters(), 1e-2), _std, {}),
    "sgd_momentum": (_mlp, lambda m: torch.optim.SGD(m.parameters(), 0.1, momentum=0.9), _std, {}),
    "adamw": (_mlp, lambda m: torch.optim.AdamW(m.parameters(), 1e-2), _std, {}),
    "rmsprop": (_mlp, lambda m: torch.optim.RMSprop(m.parameters(), 1e-2), _std, {}),
    "adagrad": (_mlp, lambda m: torch.optim.Adagrad(m.parameters(), 1e-2), _std, {}),
    "adam_fused_tensor_lr": (_mlp, lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2), fused=True), _std, {}),
    "param_groups": (_mlp, lambda m: torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.1},
                                                       {"params": m[3].parameters(), "lr": 0.01}]), _std, {}),
    "lbfgs_closure": (_mlp, lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3), _lbfgs, {}),
    "frozen": (lambda: _frozen(),
               lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], 0.1), _std, {}),
    "tied": (_tied, lambda m: torch.optim.Adam(m.parameters(), 1e-2), _std, {}),
    "bf16_model": (lambda: _mlp().bfloat16(), lambda m: torch.optim.AdamW(m.parameters(), 1e-2), "bf16", {}),
    "gradscaler_cpu": (_mlp, lambda m: torch.optim.SGD(m.parameters(), 0.1), _scaler,
                       {"scaler": lambda m: torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)}),
    "two_optimizers_one_watch": (_mlp, lambda m: torch.optim.SGD(m[0].parameters(), 0.1), _two_opts,
                                 {"opt2": lambda m: torch.optim.Adam(m[3].parameters(), 1e-2)}),
}


def _frozen():
    m = _mlp()
    m[0].weight.requires_grad_(False)
    return m


def _train(case, runs_dir, with_agent):
    make_model, make_opt, loop, extra_makers = CASES[case]
    torch.manual_seed(0)
    m = make_model()
    opt = make_opt(m)
    extra = {k: f(m) for k, f in extra_makers.items()}
    if loop == "bf16":
        loop = lambda m, opt, extra, x, y: _std(m, opt, extra, x.bfloat16(), y)  # noqa: E731
    w = attach(m, opt, run_id=f"{case}-{next(_ids)}", runs_dir=runs_dir, metrics_port=0, snapshot_every=2,
               scaler=extra.get("scaler")) if with_agent else None
    torch.manual_seed(1)
    losses = []
    for _ in range(6):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        loss = loop(m, opt, extra, x, y)
        losses.append(loss.detach().float().item())
        if w:
            w.step(loss, batch=(x, y))
    state = [t.detach().clone() for t in itertools.chain(m.parameters(), m.buffers())]
    if w:
        w.close()
        assert not problems(w.run_dir), problems(w.run_dir)
    return losses, state, torch.get_rng_state()


@pytest.mark.parametrize("case", sorted(CASES))
def test_agent_leaves_training_bitwise_unchanged(tmp_path, case):
    a = _train(case, tmp_path, False)
    b = _train(case, tmp_path, True)
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert torch.equal(a[2], b[2]), "the agent consumed or changed the global RNG"


# --------------------------------------------------------------- breaks (fail today)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_agent_stays_enabled_on_float64_and_complex_models(tmp_path, dtype):
    """A float64 (scientific ML) or complex-parameter model is legitimate: the agent must keep
    watching it, record the grad norm, and capture its NaN.

    Today _grad_norm() calls torch._foreach_norm(..., dtype=torch.float32) for every grad dtype:
    it raises for float64 ("should be convertible without narrowing") and complex grads, so the
    agent disables itself at the very first optimizer step (and, through the disable path, even
    crashes the loop: see test_agent_errors.py) and never captures anything.
    """
    torch.manual_seed(0)
    w_ = nn.Parameter(torch.randn(4, 2, dtype=dtype))
    m = nn.Module()
    m.w = w_
    m.forward = lambda x: (x.to(dtype) @ m.w).abs().pow(2).mean()  # type: ignore[method-assign]
    opt = torch.optim.Adam([w_], 1e-2)
    w = attach(m, opt, run_id="wide", runs_dir=tmp_path, metrics_port=0, snapshot_every=2)
    try:
        for i in range(5):
            opt.zero_grad()
            loss = m(torch.randn(8, 4))
            if i == 3:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            w.step(loss, batch=None)
        enabled = w.enabled
    finally:
        w.close()
    assert enabled, problems(w.run_dir)
    norms = [o["grad_norm"] for o in stream(w.run_dir) if o["kind"] == "step"]
    assert len(norms) == 5 and norms[0] is not None and norms[0] > 0
    assert len(w.captures) == 1


def test_sparse_embedding_with_sparse_adam_gets_a_capture(tmp_path):
    """``nn.Embedding(sparse=True)`` + ``SparseAdam`` is a standard pairing: a NaN loss must give
    one capture.

    Today the gradients stored as evidence (and, with zero_grad(set_to_none=False), the snapshot's
    gradients) are sparse and _tensor_to_numpy() fails on them, so the capture is dropped
    ("capture not written: unsupported memory format option Contiguous").
    """
    torch.manual_seed(0)
    m = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(m.parameters(), 1e-2)
    w = attach(m, opt, run_id="sparse", runs_dir=tmp_path, metrics_port=0, snapshot_every=2)
    for i in range(5):
        x = torch.randint(0, 10, (8,))
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        if i == 3:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        w.step(loss, batch=x)
    w.close()
    assert len(w.captures) == 1, problems(w.run_dir)


def test_loop_that_never_calls_the_top_level_forward_still_captures(tmp_path):
    """A loop that computes the loss through a method (``model.compute_loss(x, y)``, Lightning/HF
    style) or calls submodules directly never runs the top-level ``forward``: the agent must still
    snapshot and capture the NaN.

    Today snapshots are only taken in the model's forward pre-hook, so none is ever taken and the
    incident is dropped ("no clean snapshot in the ring; capture skipped").
    """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

        def compute_loss(self, x, y):
            return F.cross_entropy(self.head(torch.relu(self.enc(x))), y)

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    w = attach(m, opt, run_id="nofwd", runs_dir=tmp_path, metrics_port=0, snapshot_every=2)
    for i in range(6):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        if i == 3:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = m.compute_loss(x, y)
        loss.backward()
        opt.step()
        w.step(loss, batch=(x, y))
    w.close()
    assert len(w.captures) == 1, problems(w.run_dir)


MODULE_ATTR_RECIPE = '''
import torch, torch.nn as nn, torch.nn.functional as F
from sentineld.contracts.recipe import Recipe

class Net(nn.Module):
    """An ordinary model that happens to name a submodule ``module``."""
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
    def forward(self, x):
        return self.head(torch.relu(self.module(x)))

def make():
    torch.manual_seed(0)
    m = Net()
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def make_plain():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
'''


def _nan_run(rec, spec, runs, run_id):
    from sentineld.contracts.recipe import train_step
    w = attach(rec.model, rec.optimizer, run_id=run_id, runs_dir=runs,
               recipe=spec, metrics_port=0, snapshot_every=2)
    g = torch.Generator().manual_seed(0)
    with w:
        for i in range(5):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if i == 3:
                x[0, 0] = float("nan")
            w.step(train_step(rec, (x, y)), (x, y))
    return w


def test_model_with_a_submodule_named_module_is_snapshotted_whole(project):
    """A model with an attribute called ``module`` is not a DDP wrapper: its snapshot must hold
    every parameter (``head.*`` too), so the replay can load it.

    Today Watch treats any model with a ``.module`` submodule as a wrapper and snapshots only
    ``model.module``: the replay fails with "the model cannot be rebuilt: ... Missing key(s)
    'head.weight'" (exit 2).
    """
    p = project(MODULE_ATTR_RECIPE)
    rec = p.module.make()
    w = _nan_run(rec, p.spec(), p.runs, "modattr")
    assert len(w.captures) == 1
    report = replay_run(w.run_dir, trust=True)
    assert report.reproduced and report.phase in ("data", "forward")


def test_torch_compiled_model_replays_with_the_plain_recipe_model(project):
    """``attach(torch.compile(model), opt)`` is the common way to use compile: the snapshot must
    use the original module's parameter names, like the DDP ``.module`` unwrapping, so the
    recipe's plain model loads it.

    Today the snapshot keys are ``_orig_mod.0.weight``..., and the replay fails with "the model
    cannot be rebuilt" (exit 2).
    """
    from sentineld.contracts.recipe import Recipe, train_step
    p = project(MODULE_ATTR_RECIPE)
    rec = p.module.make_plain()
    compiled = torch.compile(rec.model, backend="eager")
    crec = Recipe(model=compiled, optimizer=rec.optimizer, loss_fn=rec.loss_fn)
    w = attach(compiled, rec.optimizer, run_id="compiled", runs_dir=p.runs, recipe=p.spec("make_plain"),
               metrics_port=0, snapshot_every=2)
    g = torch.Generator().manual_seed(0)
    with w:
        for i in range(5):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if i == 3:
                x[0, 0] = float("nan")
            w.step(train_step(crec, (x, y)), (x, y))
    assert len(w.captures) == 1
    report = replay_run(w.run_dir, trust=True)
    assert report.reproduced and report.phase in ("data", "forward")
