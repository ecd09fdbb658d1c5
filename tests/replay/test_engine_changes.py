"""The counterfactual engine's changes one by one, on tiny modules (no training, no capture)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.replay.counterfactual import Change, _apply_static, _dynamic, batch_size, drop_samples
from sentineld.replay.opguard import OpGuard, base_name, fp32_module, op_guard
from sentineld.replay.persample import per_sample, responsible
from sentineld.replay.whatif import p99
from sentineld.contracts.recipe import Recipe, train_step


class LogSig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)  # logits = sum(x) + b: -900 for _x()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.lin(x)))


def _x() -> torch.Tensor:
    return torch.full((4, 3), -300.0)  # sigmoid underflows to exactly 0: log(0)


def test_eps_guard_makes_forward_and_backward_finite() -> None:
    torch.manual_seed(0)
    m = LogSig()
    assert not torch.isfinite(m(_x())).all()
    with op_guard(m, OpGuard("aten.log", "", "eps")) as g:
        out = m(_x())
        out.sum().backward()
    assert g.applied == 1 and torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())  # the clamp is in the graph


def test_rewrite_log_sigmoid_is_logsigmoid() -> None:
    torch.manual_seed(0)
    m = LogSig()
    x = torch.randn(4, 3) * 50
    with op_guard(m, OpGuard("log", None, "rewrite")) as g:
        out = m(x)
    assert g.applied == 1 and torch.allclose(out, F.logsigmoid(m.lin(x)))


def test_rewrite_carries_through_the_ops_between_softmax_and_log() -> None:
    """A hand-written NLL picks the label's column before the log: log(softmax(z)[rows, y]) is
    log_softmax(z)[rows, y], gather/squeeze/indexing alike; the rewrite used to change nothing."""
    z = torch.tensor([[0.0, 200.0, -200.0], [5.0, 1.0, 0.0]], requires_grad=True)
    y = torch.tensor([2, 0])
    want = F.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    for pick in (lambda p: p.gather(1, y[:, None]).squeeze(1), lambda p: p[torch.arange(2), y],
                 lambda p: torch.gather(p, 1, y.view(2, 1)).flatten()):
        assert torch.isinf(torch.log(pick(torch.softmax(z, -1)))).any()  # softmax gives an exact 0
        with op_guard(nn.Identity(), OpGuard("aten.log", None, "rewrite")) as g:
            out = torch.log(pick(torch.softmax(z, -1)))
        assert (g.applied, g.calls, g.rewrites) == (1, 1, ["log_softmax"])
        assert torch.isfinite(out).all() and torch.allclose(out, want)
        (gz,) = torch.autograd.grad(-out.sum(), z)
        assert torch.isfinite(gz).all()


def test_rewrite_skips_a_producer_output_changed_in_place() -> None:
    # softmax, then an in-place edit: log(p) is no longer log_softmax(z), so nothing is rewritten
    z = torch.tensor([[0.0, 50.0, -50.0]])
    for edit in (lambda p: p.clamp_(min=0.25), lambda p: p.__setitem__((0, 2), 0.5), lambda p: p.mul_(2.0)):
        with op_guard(nn.Identity(), OpGuard("log", None, "rewrite")) as g:
            p = torch.softmax(z, -1)
            edit(p)
            out = torch.log(p)
        assert (g.applied, g.calls) == (0, 1) and torch.equal(out, torch.log(p))


def test_guard_counts_calls_it_could_not_change() -> None:
    """A log of a ReLU output has nothing to rewrite: 0 applied but 1 call, and the table says the
    op ran (the verdict named it) instead of "(the op never ran there)"."""
    from sentineld.contracts.render_cf import what_if_lines

    x = torch.tensor([0.0, 1.0])
    with op_guard(nn.Identity(), OpGuard("log", None, "rewrite")) as g:
        torch.log(torch.relu(x))
    assert (g.applied, g.calls) == (0, 1)
    row = {"change": "stable rewrite of aten.log", "finite": False, "steps_checked": 1,
           "loss": math.inf, "loss_distance": None, "applied": 0, "op_calls": 1}
    text = "\n".join(what_if_lines({"what_if": [row]}))
    assert "never ran" not in text and "ran 1x, input not from sigmoid/softmax/1+x/1+exp" in text
    assert "(the op never ran there)" in "\n".join(what_if_lines({"what_if": [{**row, "op_calls": 0}]}))


def test_guard_only_inside_its_module() -> None:
    m = LogSig()
    with op_guard(m, OpGuard("log", "lin", "eps")) as g:  # the log runs outside `lin`
        m(_x())
    assert g.applied == 0 and g.calls == 0


def test_fp32_module_under_autocast() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(torch.randn(2, 3)).dtype == torch.bfloat16
        with fp32_module(m, "1"):
            assert m(torch.randn(2, 3)).dtype == torch.float32
    assert "forward" not in vars(m[1])  # restored


def test_batch_changes_and_lr_scale_restores_the_lr() -> None:
    batch = (torch.arange(10.0).reshape(5, 2), torch.arange(5), "meta")
    assert batch_size(batch) == 5
    x, y, meta = drop_samples(batch, (1, 3))
    assert y.tolist() == [0, 2, 4] and x.shape == (3, 2) and meta == "meta"
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    rec = Recipe(model=m, optimizer=opt, loss_fn=lambda mod, b: mod(b).pow(2).mean())
    ref = nn.Linear(2, 2)
    ref.load_state_dict(m.state_dict())
    seen = []
    with _dynamic(rec, Change(lr_scale=0.1), lambda s, r: seen.append(r.optimizer.param_groups[0]["lr"]), [0]):
        train_step(rec, torch.ones(3, 2))
    assert seen == [0.5] and opt.param_groups[0]["lr"] == 0.5  # scaled inside the step only
    ref_rec = Recipe(model=ref, optimizer=torch.optim.SGD(ref.parameters(), lr=0.05), loss_fn=rec.loss_fn)
    train_step(ref_rec, torch.ones(3, 2))
    assert torch.equal(m.weight, ref.weight)  # the step took lr 0.05


def test_dtype_and_eps_are_applied() -> None:
    m = nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-8)
    rec = Recipe(model=m, optimizer=opt, loss_fn=lambda mod, b: mod(b).sum(), autocast_dtype=torch.bfloat16)
    train_step(rec, torch.ones(1, 2))
    _apply_static(rec, Change(dtype="float64", optimizer_eps=1e-6, clip_norm=2.0))
    assert m.weight.dtype == torch.float64 and rec.autocast_dtype is None and rec.clip_grad_norm == 2.0
    assert opt.state[m.weight]["exp_avg_sq"].dtype == torch.float64 and opt.param_groups[0]["eps"] == 1e-6
    train_step(rec, torch.ones(1, 2, dtype=torch.float64))  # the step runs in float64


def test_per_sample_names_the_outliers_vmap_and_loop_agree() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    x[[2, 9]] *= -40
    rec = Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), 0.1),
                 loss_fn=lambda mod, b: F.cross_entropy(mod(b[0]), b[1]))
    ps = per_sample(rec, (x, y))
    assert ps["method"] == "vmap"
    assert set(responsible(ps)[:2]) == {2, 9}
    bn = Recipe(model=nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)),
                optimizer=torch.optim.SGD(m.parameters(), 0.1), loss_fn=rec.loss_fn)
    assert per_sample(bn, (x, y))["method"] in ("loop", "loop_eval")  # BatchNorm: not vmap-able


def test_names_and_p99() -> None:
    assert base_name("aten.log.default") == "log" and base_name("aten.log_") == "log" and base_name(None) is None
    assert p99([1.0] * 99 + [5.0]) == 1.0 and p99([float("nan")]) is None
    assert p99([1.0, 2.0, 1e6]) == 2.0  # a diverging stretch is not the run's usual norm
