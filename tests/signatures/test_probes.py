"""sentineld.agent.probes: what the probes measure, when, at what cost, and that remove() restores."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sentineld.agent.probes import DENSE_STEPS, attach_probes, sampled_at

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def hook_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, m in model.named_modules():
        for d in HOOK_DICTS:
            state[f"{name}.{d}"] = list(getattr(m, d, {}).keys())
        state[f"{name}.__dict__"] = sorted(m.__dict__)
    state["opt.pre"] = list(opt._optimizer_step_pre_hooks.keys())
    state["opt.post"] = list(opt._optimizer_step_post_hooks.keys())
    state["opt.__dict__"] = sorted(opt.__dict__)
    return state


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
         call_step: bool = True) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if call_step:
        opt.step()


def batch(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_remove_restores_model_and_optimizer_exactly() -> None:
    model = net()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    user_hook = model[1].register_forward_hook(lambda m, i, o: None)    # the user's own
    before = hook_state(model, opt)
    x, y = batch()
    probes = attach_probes(model, opt, every=2)
    for s in range(4):
        probes.begin_step(s)
        step(model, opt, x, y)
        probes.collect()
    assert hook_state(model, opt) != before
    probes.remove()
    assert hook_state(model, opt) == before
    assert len(model[1]._forward_hooks) == 1      # the user's hook is still there
    user_hook.remove()
    assert all(not m._forward_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert probes.collect() is None and probes.begin_step(4) is False
    probes.remove()                                 # idempotent


def test_probes_do_not_change_training() -> None:
    x, y = batch()
    runs = []
    for attach in (False, True):
        model = net()
        opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
        probes = attach_probes(model, opt, every=1) if attach else None
        for s in range(5):
            if probes:
                probes.begin_step(s)
            step(model, opt, x, y)
            if probes:
                probes.collect()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_sampling_cadence() -> None:
    """Dense at the start (every step for 2 here), gap doubling, then every 3 steps."""
    model, x, y = net(), *batch()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with attach_probes(model, opt, every=3, dense=2) as probes:
        got = []
        for s in range(16):
            assert probes.begin_step(s) == sampled_at(s, 3, 2)
            step(model, opt, x, y)
            if probes.collect() is not None:
                got.append(s)
    # 0, 1 dense; 2, 3 gap 1; 4..7 gap 2; from 8 on the gap (4) reaches every: multiples of 3
    assert got == [0, 1, 2, 3, 4, 6, 9, 12, 15]
    with attach_probes(net(), opt, every=3, dense=0) as plain:
        assert [s for s in range(7) if plain.begin_step(s)] == [0, 3, 6]


def test_sampling_schedule_default() -> None:
    every = 50
    steps = [s for s in range(2000) if sampled_at(s, every)]
    assert steps[:DENSE_STEPS] == list(range(DENSE_STEPS))
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert all(g <= max(1, s // DENSE_STEPS) for s, g in zip(steps[1:], gaps))   # gap <= s/16
    head = [g for s, g in zip(steps[1:], gaps) if s < DENSE_STEPS * 64]
    assert head == sorted(head) and max(gaps) < 2 * every                        # backs off
    assert set(gaps[-18:]) == {every}
    assert all(s % every == 0 for s in steps if s >= DENSE_STEPS * 64)            # then steady
    assert len(steps) == 131      # vs 40 for plain every=50: 91 extra samples, once per run
    # a resumed run (first step 5000) is sampled densely again, then aligned to every
    resumed = [s for s in range(5000, 7000) if sampled_at(s, every, first=5000)]
    assert resumed[:DENSE_STEPS] == list(range(5000, 5000 + DENSE_STEPS))
    assert resumed[-1] % every == 0 and len(resumed) == len(steps)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_unsampled_steps_run_no_tensor_op() -> None:
    """On a step that is not sampled the hooks add not a single aten op (so no device sync)."""
    x, y = batch()
    counts = []
    for attach in (False, True):
        model = net()
        opt = torch.optim.SGD(model.parameters(), 0.1)
        probes = attach_probes(model, opt, every=10, dense=0) if attach else None
        if probes:
            probes.begin_step(0)
            step(model, opt, x, y)
            probes.collect()
            probes.begin_step(1)
        else:
            step(model, opt, x, y)
        with _CountOps() as mode:
            step(model, opt, x, y)
            if probes:
                assert probes.collect() is None
        counts.append(mode.ops)
    assert counts[0] == counts[1]


def test_dead_fraction_saturation_and_norms() -> None:
    model = net()
    with torch.no_grad():
        model[0].bias[:4] = -1e3            # 4 of 8 ReLU units can never fire
        model[2].weight.mul_(100.0)         # most tanh outputs saturate
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = batch(64)
    probes = attach_probes(model, opt, every=1)
    probes.begin_step(0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    def per_module(fn: Any) -> dict[str, float]:
        return {n: math.sqrt(sum(float(fn(p)) ** 2 for p in m.parameters(recurse=False)))
                for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    grads = per_module(lambda p: p.grad.norm())
    w_before = per_module(lambda p: p.detach().norm())
    deltas = per_module(lambda p: (0.1 * p.grad).norm())
    opt.step()
    stats = probes.collect()
    probes.remove()
    assert stats is not None
    assert set(stats) == {"0", "1", "2", "3", "4"}
    assert stats["1"].dead_fraction == pytest.approx(0.5, abs=1 / 8)
    assert stats["3"].saturated_fraction is not None and stats["3"].saturated_fraction > 0.5
    assert stats["3"].dead_fraction is None and stats["1"].saturated_fraction is None
    for n in ("0", "2", "4"):
        assert stats[n].grad_norm == pytest.approx(grads[n], rel=1e-4)
        assert stats[n].update_ratio == pytest.approx(deltas[n] / w_before[n], rel=1e-3)
        now = math.sqrt(sum(float(p.detach().norm()) ** 2 for p in model[int(n)].parameters()))
        assert stats[n].param_norm == pytest.approx(now, rel=1e-4)


def test_accumulates_dead_mask_over_micro_batches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 2, bias=False), nn.ReLU(), nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0], [-1.0]]))
    opt = torch.optim.SGD(model.parameters(), 0.0)
    probes = attach_probes(model, opt, every=1)
    probes.begin_step(0)
    opt.zero_grad()
    for sign in (1.0, -1.0):      # unit 0 fires on the first micro-batch, unit 1 on the second
        F.cross_entropy(model(torch.full((4, 1), sign)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    assert probes.collect()["1"].dead_fraction == 0.0
    probes.begin_step(1)
    opt.zero_grad()
    F.cross_entropy(model(torch.full((4, 1), 1.0)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    assert probes.collect()["1"].dead_fraction == 0.5
    probes.remove()


def test_output_activation_left_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.Linear(8, 1), nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with attach_probes(model, opt, every=1) as probes:
        probes.begin_step(0)
        opt.zero_grad()
        F.binary_cross_entropy(model(torch.randn(8, 4)), torch.ones(8, 1)).backward()
        opt.step()
        stats = probes.collect()
    assert stats["1"].saturated_fraction is not None
    assert "3" not in stats or stats["3"].saturated_fraction is None


def test_update_ratio_zero_when_step_not_run_or_param_not_in_optimizer() -> None:
    model, (x, y) = net(), batch()
    opt = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), 0.1)
    with attach_probes(model, opt, every=1) as probes:
        probes.begin_step(0)
        step(model, opt, x, y)
        stats = probes.collect()
        assert stats["0"].update_ratio > 0 and stats["2"].update_ratio > 0
        assert stats["4"].update_ratio == 0.0 and stats["4"].grad_norm > 0   # not in optimizer
        probes.begin_step(1)
        step(model, opt, x, y, call_step=False)                           # forgot step()
        stats = probes.collect()
        assert all(stats[n].update_ratio == 0.0 for n in ("0", "2", "4"))
        assert all(stats[n].grad_norm > 0 for n in ("0", "2", "4"))


def test_frozen_and_detached_parameters() -> None:
    model, (x, y) = net(), batch()
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 0.1)
    orig = model[1].forward
    model[1].forward = lambda t: orig(t.detach())        # graph cut after layer 0
    with attach_probes(model, opt, every=1) as probes:
        probes.begin_step(0)
        step(model, opt, x, y)
        stats = probes.collect()
    assert "2" not in stats                                # frozen: nothing to report
    assert stats["0"].grad_norm is None and stats["0"].param_norm > 0
    assert stats["4"].grad_norm > 0


def test_gradscaler_skipped_step() -> None:
    model, (x, y) = net(), batch()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = torch.amp.GradScaler("cpu")
    with attach_probes(model, opt, every=1) as probes:
        probes.begin_step(0)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y) * math.inf).backward()
        scaler.step(opt)
        scaler.update()
        stats = probes.collect()
    assert stats is not None
    with_params = [s for s in stats.values() if s.param_norm is not None]
    assert len(with_params) == 3  # the three Linear layers: the all() below is not vacuous
    assert all(s.update_ratio == 0.0 for s in with_params)


def test_internal_error_switches_probes_off(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    model, (x, y) = net(), batch()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    probes = attach_probes(model, opt, every=1)

    def boom(*a: Any) -> None:
        raise RuntimeError("boom")
    monkeypatch.setattr(probes._acts, "_dead", boom)
    probes.begin_step(0)
    step(model, opt, x, y)                     # training is not interrupted
    assert probes.collect() is None and probes.enabled is False
    assert "switched off" in caplog.text
    assert probes.begin_step(1) is False
    probes.remove()
    assert all(not m._forward_hooks for m in model.modules())


def test_transformer_and_conv_shapes() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                       activation=nn.GELU())
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(2),
                          nn.Linear(16, 16), nn.GELU(), layer)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with attach_probes(model, opt, every=1) as probes:
        probes.begin_step(0)
        opt.zero_grad()
        model(torch.randn(3, 1, 4, 4)).square().mean().backward()
        opt.step()
        stats = probes.collect()
    assert 0.0 <= stats["1"].dead_fraction <= 1.0          # (B, C, H, W): per channel
    assert 0.0 <= stats["4"].dead_fraction <= 1.0          # (B, T, F): per feature
    assert stats["5.linear1"].update_ratio > 0


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "3"])
def test_attach_validates_every(every: Any) -> None:
    with pytest.raises(ValueError, match="every"):
        attach_probes(net(), None, every=every)


def test_attach_validates_types() -> None:
    with pytest.raises(TypeError, match="model"):
        attach_probes("model", None, every=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        attach_probes(net(), [object()], every=1)  # type: ignore[list-item]


def test_no_optimizer_means_no_update_ratio() -> None:
    model, (x, y) = net(), batch()
    with attach_probes(model, None, every=1) as probes:
        probes.begin_step(0)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        stats = probes.collect()
    assert stats["0"].update_ratio is None and stats["0"].grad_norm > 0
