"""sentineld.agent.actmode and .acthooks through the probes: activations called as functions inside a forward
are measured and named after the innermost module; nothing is left behind; the onset rule."""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sentineld.agent.actmode import DEAD_INPUT
from sentineld.agent.probes import attach_probes
from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.signatures import SignatureConfig, detect_dead_relu
from sentineld.signatures.activations import onsets

CFG = SignatureConfig()


class Net(nn.Module):
    """fc1 -> ``act`` called in the root's own forward -> inner = (fc2, ``inner_act``) -> head."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor],
                 inner_act: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.act = act
        self.inner = nn.Sequential(nn.Linear(8, 8), inner_act or nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.act(self.fc1(x))))


def one_step(model: nn.Module, probes: Any, step: int = 0, n: int = 64,
             call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
             ) -> dict[str, LayerStats]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    probes.begin_step(step)
    model.zero_grad()
    out = call(model, x) if call else model(x)
    F.cross_entropy(out, y).backward()
    return probes.collect()


def planted(model: Net) -> Net:
    with torch.no_grad():
        model.fc1.bias[:6] = -100.0          # 6 of fc1's 8 units never active
    return model


@pytest.mark.parametrize("act, op", [
    (F.relu, "relu"), (torch.relu, "relu"), (lambda t: t.relu(), "relu"),
    (lambda t: F.relu(t, inplace=True), "relu"), (nn.ReLU(inplace=True), "relu"),
    (F.gelu, "gelu"), (lambda t: F.gelu(t, approximate="tanh"), "gelu"), (F.silu, "silu"),
    (lambda t: F.silu(t, inplace=True), "silu"), (F.mish, "mish"), (F.elu, "elu"),
    (F.selu, "selu"), (F.hardswish, "hardswish"), (F.relu6, "relu6"), (nn.ReLU6(), "relu6"),
    (nn.GELU(), "gelu"), (nn.SiLU(), "silu")],
    ids=["F.relu", "torch.relu", "Tensor.relu", "F.relu_inplace", "nn.ReLU_inplace", "F.gelu",
         "F.gelu_tanh", "F.silu", "F.silu_inplace", "F.mish", "F.elu", "F.selu", "F.hardswish",
         "F.relu6", "nn.ReLU6", "nn.GELU", "nn.SiLU"])
def test_functional_activation_measured_and_attributed(act: Any, op: str) -> None:
    model = planted(Net(act))
    with attach_probes(model, torch.optim.SGD(model.parameters(), 0.0), every=1) as probes:
        stats = one_step(model, probes)
    where = "act" if isinstance(act, nn.Module) else ""       # a module, or the root's forward
    assert stats[where].dead_fraction == pytest.approx(6 / 8), stats[where]
    assert stats[where].activation == op
    assert stats["inner.1"].activation == "relu"
    with torch.no_grad():            # the same batch as one_step's: the inner ReLU's true figure
        x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
        z = model.inner[0](act(model.fc1(x)))
    assert stats["inner.1"].dead_fraction == pytest.approx(float((z <= 0).all(0).float().mean()))


def test_smooth_activation_is_not_dead_below_zero() -> None:
    """GELU units with a negative input still learn (slope up to -0.17): only the flat region
    (x < -3.07) is dead; "never > 0" would have called all 8 dead here."""
    model = Net(F.gelu)
    with torch.no_grad():
        model.fc1.bias[:4] = -1.5            # negative, but in the region with a slope
        model.fc1.bias[4:] = -100.0          # flat region
        model.fc1.weight.mul_(0.01)
    with attach_probes(model, None, every=1) as probes:
        stats = one_step(model, probes)
    assert stats[""].dead_fraction == pytest.approx(0.5)


def test_saturation_functional_and_worst_call_reported() -> None:
    model = Net(torch.tanh, nn.Sigmoid())
    with torch.no_grad():
        model.fc1.weight.mul_(100.0)
    with attach_probes(model, None, every=1) as probes:
        stats = one_step(model, probes)
    root, inner = stats[""].saturated_fraction, stats["inner.1"].saturated_fraction
    assert root is not None and root > 0.5 and stats[""].activation == "tanh"
    assert inner is not None and inner < 0.5 and stats["inner.1"].activation == "sigmoid"
    assert stats[""].dead_fraction is None and stats["inner.1"].dead_fraction is None


def test_two_calls_in_one_module_worst_named() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
            with torch.no_grad():
                self.b.bias.fill_(-100.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.relu(self.b(F.relu(self.a(x)))))
    model = Two()
    with attach_probes(model, None, every=1) as probes:
        stats = one_step(model, probes)
    assert stats[""].dead_fraction == 1.0 and stats[""].activation == "relu#2"


def test_output_activation_and_calls_outside_the_model_left_out() -> None:
    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.fc(x) * 100)        # saturated, but it is the prediction
    model = Out()
    with attach_probes(model, None, every=1) as probes:
        probes.begin_step(0)
        x = torch.randn(32, 6)
        out = model(x)
        loss = torch.tanh(out * 1e3).mean() + F.relu(out - 10).sum()   # in the loss, outside
        loss.backward()
        stats = probes.collect()
    assert set(stats) == {"fc"}


def test_no_grad_forward_and_submodule_called_directly() -> None:
    model = planted(Net(F.relu))
    with attach_probes(model, None, every=1) as probes:
        probes.begin_step(0)
        with torch.no_grad():
            model(torch.randn(8, 6))                          # an eval pass: not measured
        h = model.inner(torch.randn(8, 8, requires_grad=True))    # a framework's direct call
        F.relu(h).sum().backward()                                # outside any module
        stats = probes.collect()
    assert "" not in stats                                        # the eval pass left nothing
    assert stats["inner.1"].dead_fraction is not None             # the submodule's own ReLU


def test_nothing_left_behind_and_nothing_on_unsampled_steps() -> None:
    reg = nn.modules.module
    model = planted(Net(F.relu))
    seen: list[tuple[int, int]] = []
    model.fc1.register_forward_hook(lambda m, a, o: seen.append(
        (len(reg._global_forward_pre_hooks), torch._C._len_torch_function_stack())))
    with attach_probes(model, None, every=4, dense=0) as probes:
        one_step(model, probes, 0)
        one_step(model, probes, 1)
        assert seen == [(1, 1), (0, 0)]          # stack hooks + mode on the sampled step only
        assert not reg._global_forward_pre_hooks and not reg._global_forward_hooks
        assert torch._C._len_torch_function_stack() == 0
        probes.begin_step(4)                      # a sampled step whose forward raises
        with pytest.raises(RuntimeError, match="shapes"):
            model(torch.randn(3, 5))
        assert torch._C._len_torch_function_stack() == 0
        assert probes.collect() is not None
        assert not reg._global_forward_pre_hooks and not reg._global_forward_hooks


def test_other_threads_forwards_not_counted() -> None:
    model = planted(Net(F.relu))
    other = Net(F.relu)                            # healthy, forwarded by another thread
    with attach_probes(model, None, every=1) as probes:
        probes.begin_step(0)
        t = threading.Thread(target=lambda: model(torch.randn(8, 6)).sum().backward())
        t.start()
        t.join()
        other(torch.randn(8, 6))
        stats = probes.collect()
    assert stats.get("") is None or stats[""].dead_fraction is None


# ------------------------------------------------------------------ the onset rule (pure)
def records(fracs: Sequence[float | None], every: int = 1) -> list[StepRecord]:
    return [StepRecord(step=i * every, loss=1.0, layers=None if f is None else
                       {"act": LayerStats(dead_fraction=f, activation="relu")})
            for i, f in enumerate(fracs)]


@pytest.mark.parametrize("fracs, onset", [
    ([0.1, 0.8, 0.8, 0.9], 1),
    ([0.1, 0.8, 0.8, 0.65, 0.8, 0.9], 1),      # dipped into the band: the same condition
    ([0.8, 0.8, 0.3, 0.8, 0.8], 3),            # revived, then died again: the new onset
    ([0.8, 0.6, 0.8, 0.6], None),              # never two in a row over 0.7
    ([0.1, 0.8, 0.8, 0.4], None),              # revived now
    ([0.9, 0.9, None, 0.9], 0),                # a record without layers is no sample
])
def test_onset_rule(fracs: list[float | None], onset: int | None) -> None:
    out = detect_dead_relu(records(fracs), CFG.dead_relu)
    assert [v.step for v in out] == ([] if onset is None else [onset])
    if out:
        assert out[0].numbers["onset_step"] == onset and "(relu)" in out[0].message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60))
def test_onset_does_not_depend_on_when_it_is_read(fracs: list[float]) -> None:
    """Evaluated after every sample or once at the end: while the condition holds, its onset
    stays the one named when it first fired."""
    rs = records(fracs)
    c = CFG.dead_relu
    named: int | None = None
    for i in range(1, len(rs) + 1):
        now = onsets(rs[:i], "dead_fraction", c.max_fraction, c.release_fraction, c.patience)
        if "act" not in now:
            named = None
        elif named is None:
            named = now["act"][0]
        else:
            assert now["act"][0] == named
    end = onsets(rs, "dead_fraction", c.max_fraction, c.release_fraction, c.patience)
    assert (end["act"][0] if "act" in end else None) == named


def test_function_mode_does_not_change_training_bit_for_bit() -> None:
    """A transformer with dropout and GELU trained with every step sampled (the mode on in every
    forward) ends with exactly the parameters of the same run without probes; the eval pass in
    between (no grad: the mode stays off, MHA's fast path is free to run) gives equal outputs."""
    def run(with_probes: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True,
                                           activation="gelu")
        model = nn.Sequential(nn.Linear(4, 16), layer)
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        probes = attach_probes(model, opt, every=1) if with_probes else None
        g = torch.Generator().manual_seed(1)
        evals = []
        for s in range(4):
            x = torch.randn(3, 5, 4, generator=g)
            if probes:
                probes.begin_step(s)
            model.train()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                evals.append(model(x))
            if probes:
                assert probes.collect() is not None
        if probes:
            probes.remove()
        return [p.detach().clone() for p in model.parameters()], torch.stack(evals)
    (a, ea), (b, eb) = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(ea, eb)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on the CI machine)")
def test_cuda_sampled_forward_and_backward_do_not_sync() -> None:
    """On CUDA the activation probe adds no host-device sync to a sampled step's forward,
    backward and optimizer step; the one read-back is collect()'s, as before."""
    model = Net(F.gelu).cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(64, 6, device="cuda"), torch.randint(0, 3, (64,), device="cuda")
    with attach_probes(model, opt, every=1) as probes:
        for s in range(2):
            probes.begin_step(s)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            stats = probes.collect()
            assert stats[""].dead_fraction is not None


@pytest.mark.parametrize("act, level", [("relu", 0.0), ("gelu", DEAD_INPUT["gelu"])])
def test_transformer_layer_activation_measured_without_the_function_mode(act: str, level: float) -> None:
    """nn.TransformerEncoderLayer calls its activation as a function (F.relu / F.gelu) on
    linear1's output: measured there, named after the layer, with no function mode inside the
    layer (issue 23: the mode's handler on every op of the layer cost ~20% of a sampled step)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                                             activation=act), 2)
    with torch.no_grad():
        model.layers[1].linear1.bias[:20] = -100.0          # 20 of 32 units never leave the dead region
    truth: dict[int, float] = {}
    modes: list[int] = []
    for i, layer in enumerate(model.layers):
        layer.linear1.register_forward_hook(lambda m, a, o, i=i: truth.__setitem__(
            i, float((o <= level).all(0).all(0).float().mean())))
        layer.norm2.register_forward_pre_hook(lambda m, a: modes.append(torch._C._len_torch_function_stack()))
    with attach_probes(model, torch.optim.SGD(model.parameters(), 0.1), every=1) as probes:
        probes.begin_step(0)
        model(torch.randn(4, 5, 16)).sum().backward()
        stats = probes.collect()
    assert stats is not None
    assert stats["layers.1"].dead_fraction == pytest.approx(truth[1]) == pytest.approx(20 / 32)
    assert stats["layers.0"].dead_fraction == pytest.approx(truth[0])
    assert stats["layers.1"].activation == act
    assert modes == [0, 0]
