"""A full layer sample reuses the global grad norm's per-parameter norms (agent/probes.py,
agent/readback.py grad_norm(per_param=...)) only for a gradient unchanged since: same tensor,
same version. Real model, real optimizer, values checked against torch's own norms."""

from __future__ import annotations

import math

import torch
from torch import nn

from sentineld.agent import attach
from sentineld.agent.probes import attach_probes
from sentineld.agent.readback import grad_norm


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _l2(*ts: torch.Tensor) -> float:
    return math.sqrt(sum(float(t.double().norm()) ** 2 for t in ts))


def test_a_gradient_changed_after_the_global_norm_is_measured_anew() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), 0.0)   # lr 0: the step leaves w as it is
    x = torch.randn(16, 4)
    with attach_probes(model, opt, every=50) as probes:
        assert probes.begin_step(0)                  # step 0: a full sample
        model(x).square().mean().backward()
        shared = probes.grad_norms()
        assert shared is not None
        g = grad_norm(opt, shared)                   # what the agent's pre-hook does first
        w0, b0 = model[0].weight, model[0].bias
        assert set(shared) == {id(p) for p in model.parameters()}
        assert g is not None and math.isclose(float(g), _l2(*(p.grad for p in model.parameters())), rel_tol=1e-5)
        with torch.no_grad():
            w0.grad.mul_(3.0)                        # in place, after the global norm: version moves
        opt.step()
        stats = probes.collect()
    assert stats is not None
    # layer 0's weight gradient was re-taken (3x), its bias's reused; both match torch's norms
    assert math.isclose(stats["0"].grad_norm, _l2(w0.grad, b0.grad), rel_tol=1e-5)
    assert math.isclose(stats["2"].grad_norm, _l2(model[2].weight.grad, model[2].bias.grad), rel_tol=1e-5)


def test_not_a_full_sample_nothing_is_shared() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with attach_probes(model, opt, every=50) as probes:
        probes.begin_step(0)
        probes.collect()
        assert probes.begin_step(3)                  # sampled, activations only (full_at)
        assert probes.grad_norms() is None


def test_watched_run_records_the_same_layer_grad_norms(tmp_path) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    x = torch.randn(16, 4)
    with attach(model, opt, run_id="reuse", runs_dir=tmp_path, metrics_port=0, localize="off",
                capture_on_sigterm=False) as watch:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        expected = {"0": _l2(model[0].weight.grad, model[0].bias.grad),
                    "2": _l2(model[2].weight.grad, model[2].bias.grad)}
        opt.step()
        watch.step(loss, batch=x)
        layers = watch.latest.layers
    for name, want in expected.items():
        assert math.isclose(layers[name].grad_norm, want, rel_tol=1e-5), (name, layers[name], want)
