"""Healthy and faulty tiny training runs (CPU, about a second each) for the signature tests.

Each :class:`Scenario` trains with :func:`harness.train` and names the signature its fault must
raise, the step the fault starts, and the latency bound (in steps) the tests assert. Healthy
scenarios expect no verdict at all. Runs are cached per process (:func:`records_of`), so the
tests and bench/signature_latency.py train each run once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests.signatures.harness import Loop, batches, cnn_bn, digits, mlp, train, transformer
from sentineld.contracts.records import StepRecord
from sentineld.signatures import SignatureConfig, Verdict, evaluate

__all__ = ["Scenario", "HEALTHY", "FAULTY", "records_of", "replay_daemon", "first_fire",
           "WINDOW"]

#: records per evaluate call, as the daemon keeps them
WINDOW = 200


@dataclass(frozen=True)
class Scenario:
    """One run: how to train it, and what the signatures must say about it."""

    name: str
    run: Callable[[], list[StepRecord]]
    expect: str | None = None       # signature the fault must raise; None = healthy
    fault_step: int = 0
    max_latency: int = 0            # steps from fault_step to the first verdict, inclusive bound
    num_classes: int | None = 10
    description: str = ""


# ----------------------------------------------------------------------------- helpers
def _data(batch: int = 64, image: bool = False, seed: int = 0) -> Any:
    x, y = digits(image=image)
    return batches(x, y, batch, seed=seed)


def _binary_data(batch: int = 64) -> Any:
    x, y = digits()
    return batches(x, (y >= 5).float().unsqueeze(1), batch)


def _lambda(opt: torch.optim.Optimizer, fn: Callable[[int], float]) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def _warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def f(s: int) -> float:
        if s < warmup:
            return s / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))
    return f


def _at(step: int, action: Callable[[nn.Module, torch.optim.Optimizer, Loop], None]) -> Any:
    def fault(s: int, model: nn.Module, opt: torch.optim.Optimizer, loop: Loop) -> None:
        if s == step:
            with torch.no_grad():
                action(model, opt, loop)
    return fault


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


# ----------------------------------------------------------------------------- healthy runs
def h_mlp_adam() -> list[StepRecord]:
    m = mlp()
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=300)


def h_mlp_sgd_momentum() -> list[StepRecord]:
    m = mlp(seed=1)
    opt = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, weight_decay=1e-4)
    return train(m, opt, _data(seed=1), steps=300)


def h_cnn_bn() -> list[StepRecord]:
    m = cnn_bn()
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    return train(m, opt, _data(image=True), steps=250)


def h_transformer_warmup_cosine() -> list[StepRecord]:
    m = transformer()
    opt = torch.optim.AdamW(m.parameters(), 2e-3, weight_decay=0.01)
    return train(m, opt, _data(batch=32), steps=250,
                 scheduler=_lambda(opt, _warmup_cosine(25, 250)), clip=1.0)


def h_high_lr_noisy() -> list[StepRecord]:
    m = mlp(seed=2)
    opt = torch.optim.SGD(m.parameters(), 0.3)
    return train(m, opt, _data(batch=8, seed=2), steps=400)


def h_warmup_from_zero_cosine() -> list[StepRecord]:
    m = mlp(seed=3)
    opt = torch.optim.AdamW(m.parameters(), 3e-3)
    return train(m, opt, _data(seed=3), steps=300, scheduler=_lambda(opt, _warmup_cosine(40, 300)))


def h_amp_fp16_gradscaler() -> list[StepRecord]:
    m = mlp(seed=4)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    # a high start and a short growth interval make GradScaler skip steps now and then,
    # exactly as it does on long GPU runs: scale halves on overflow, then regrows
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=25)
    return train(m, opt, _data(seed=4), steps=300, scaler=scaler, amp_dtype=torch.float16)


def h_amp_bf16() -> list[StepRecord]:
    m = mlp(widths=(64, 128, 128, 10), act=nn.SiLU, seed=5)
    opt = torch.optim.Adam(m.parameters(), 2e-3)
    return train(m, opt, _data(seed=5), steps=200, amp_dtype=torch.bfloat16)


def h_grad_accumulation() -> list[StepRecord]:
    m = mlp(seed=6)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return train(m, opt, _data(batch=16, seed=6), steps=200, accum=4)


def h_tanh_mlp() -> list[StepRecord]:
    m = mlp(act=nn.Tanh, seed=7)
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(seed=7), steps=300)


def h_sigmoid_binary() -> list[StepRecord]:
    torch.manual_seed(8)
    m = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
    return train(m, torch.optim.Adam(m.parameters(), 3e-3), _binary_data(), steps=300,
                 loss_fn=F.binary_cross_entropy)


def h_overfit_small_batch() -> list[StepRecord]:
    # the method's rule #1: overfit one batch of 32 to ~0 loss (converged, flat, tiny gradients)
    x, y = digits()
    m = mlp(seed=9)

    def one_batch() -> Any:
        while True:
            yield x[:32], y[:32]
    return train(m, torch.optim.Adam(m.parameters(), 3e-3), one_batch(), steps=300)


def h_residual_gelu_layernorm() -> list[StepRecord]:
    torch.manual_seed(10)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64)
            self.fc = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.fc(self.norm(h))

    m = nn.Sequential(nn.Linear(64, 64), *[Block() for _ in range(4)], nn.LayerNorm(64),
                      nn.Linear(64, 10))
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    return train(m, opt, _data(seed=10), steps=250)


def h_step_decay_dropout() -> list[StepRecord]:
    torch.manual_seed(11)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 150, gamma=0.1)
    return train(m, opt, _data(seed=11), steps=300, scheduler=sched)


HEALTHY: list[Scenario] = [
    Scenario("mlp_adam", h_mlp_adam, description="ReLU MLP, Adam 1e-3"),
    Scenario("mlp_sgd_momentum", h_mlp_sgd_momentum, description="ReLU MLP, SGD+momentum, wd"),
    Scenario("cnn_batchnorm", h_cnn_bn, description="CNN with BatchNorm, SGD 0.1+momentum"),
    Scenario("transformer_warmup_cosine", h_transformer_warmup_cosine,
             description="pre-norm transformer, AdamW, warmup+cosine, clipping"),
    Scenario("high_lr_noisy", h_high_lr_noisy, description="SGD lr 0.3, batch 8: noisy loss"),
    Scenario("warmup_from_zero_cosine", h_warmup_from_zero_cosine,
             description="lr warmup from 0 then cosine to 0"),
    Scenario("amp_fp16_gradscaler", h_amp_fp16_gradscaler,
             description="fp16 autocast + GradScaler skipping steps now and then"),
    Scenario("amp_bf16_silu", h_amp_bf16, description="bf16 autocast, SiLU MLP"),
    Scenario("grad_accumulation", h_grad_accumulation, description="4 micro-batches per step"),
    Scenario("tanh_mlp", h_tanh_mlp, description="Tanh MLP, Adam"),
    Scenario("sigmoid_binary", h_sigmoid_binary, num_classes=2,
             description="binary classifier with a Sigmoid output + BCE"),
    Scenario("overfit_small_batch", h_overfit_small_batch,
             description="one batch overfit to ~0 loss (converged, flat)"),
    Scenario("residual_gelu_layernorm", h_residual_gelu_layernorm,
             description="residual GELU MLP with LayerNorm"),
    Scenario("step_decay_dropout", h_step_decay_dropout,
             description="dropout, SGD, StepLR x0.1 at step 150"),
]


# ----------------------------------------------------------------------------- faulty runs
def f_nonfinite_param() -> list[StepRecord]:
    m = mlp()
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130,
                 fault=_at(100, lambda mod, o, l: mod[2].weight.__setitem__((0, 0), math.inf)))


def f_nonfinite_input() -> list[StepRecord]:
    m = mlp()

    def poison(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[0, 3] = math.nan
        return x

    def fault(s: int, mod: nn.Module, o: Any, loop: Loop) -> None:
        loop.x_fn = poison if s == 100 else None
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130, fault=fault)


def f_divergence_spike() -> list[StepRecord]:
    # a label-mapping bug in a new data shard from step 150: every label is off by one
    m = mlp()
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=200,
                 fault=_at(150, lambda mod, o, loop: setattr(loop, "y_fn", lambda y: (y + 1) % 10)))


def f_loss_spike() -> list[StepRecord]:
    # one corrupted batch at step 150: 4 of its 64 samples negated and scaled x20 (a bad shard record)
    m = mlp()

    def corrupt(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:4] *= -20.0  # flipped and scaled: confidently wrong, not just confident
        return x

    def fault(s: int, mod: nn.Module, o: Any, loop: Loop) -> None:
        loop.x_fn = corrupt if s == 150 else None
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=170, fault=fault)


def f_divergence_growth() -> list[StepRecord]:
    # a runaway schedule: from step 100 the learning rate grows 4% per step
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.02, momentum=0.9)

    def fault(s: int, mod: nn.Module, o: torch.optim.Optimizer, loop: Loop) -> None:
        if s >= 100:
            _set_lr(o, o.param_groups[0]["lr"] * 1.04)
    return train(m, opt, _data(), steps=260, fault=fault)


def f_exploding_gradients() -> list[StepRecord]:
    # a hand-written backward that scales its gradient by 1e3 (Adam hides it from the loss)
    m = mlp()

    def fault(s: int, mod: nn.Module, o: Any, loop: Loop) -> None:
        if s == 120:
            mod[0].weight.register_hook(lambda g: g * 1e3)
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=160, fault=fault)


def f_vanishing_deep_sigmoid() -> list[StepRecord]:
    m = mlp(widths=(64,) + (32,) * 10 + (10,), act=nn.Sigmoid)
    return train(m, torch.optim.SGD(m.parameters(), 0.05), _data(), steps=40)


def f_vanishing_scaled_loss() -> list[StepRecord]:
    # the loss gets divided by 1e9 from step 100 (a unit bug): gradients below 1e-7
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9)
    return train(m, opt, _data(), steps=130,
                 fault=_at(100, lambda mod, o, loop: setattr(loop, "loss_scale", 1e-9)))


def f_dead_relu() -> list[StepRecord]:
    m = mlp()
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130,
                 fault=_at(100, lambda mod, o, l: mod[2].bias.fill_(-100.0)))


def f_saturated_tanh() -> list[StepRecord]:
    m = mlp(act=nn.Tanh)
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130,
                 fault=_at(100, lambda mod, o, l: mod[0].weight.mul_(100.0)))


def f_plateau_wrong_labels() -> list[StepRecord]:
    # labels are random (a broken label pipeline): nothing to learn, loss stays at ln(10)
    m = mlp()
    g = torch.Generator().manual_seed(0)
    loop_fault = _at(0, lambda mod, o, loop: setattr(
        loop, "y_fn", lambda y: torch.randint(0, 10, y.shape, generator=g)))
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=160, fault=loop_fault)


def f_plateau_tiny_lr_no_classes() -> list[StepRecord]:
    m = mlp()
    return train(m, torch.optim.SGD(m.parameters(), 1e-6), _data(), steps=160)


def f_oscillation() -> list[StepRecord]:
    # a cyclic learning rate whose max is 100x too high from step 100 (period 20 steps): the
    # loss bounces up with every cycle instead of converging
    m = mlp(act=nn.Tanh)
    opt = torch.optim.SGD(m.parameters(), 0.05)

    def fault(s: int, mod: nn.Module, o: torch.optim.Optimizer, loop: Loop) -> None:
        if s >= 100:
            phase = ((s - 100) % 20) / 20
            _set_lr(o, 0.01 + 4.99 * (1 - abs(2 * phase - 1)))
    return train(m, opt, _data(), steps=200, fault=fault)


def f_forgot_step() -> list[StepRecord]:
    m = mlp()
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130,
                 fault=_at(100, lambda mod, o, loop: setattr(loop, "call_step", False)))


def f_layer_not_in_optimizer() -> list[StepRecord]:
    # the optimizer was built before the head was replaced: the new head never updates
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    torch.manual_seed(1)
    m[4] = nn.Linear(64, 10)
    return train(m, opt, _data(), steps=40)


def f_missing_gradients() -> list[StepRecord]:
    # a refactor at step 100 detaches the first layer's output: layer 0 gets no gradient
    m = mlp()
    orig = m[1].forward

    def fault(s: int, mod: nn.Module, o: Any, loop: Loop) -> None:
        if s == 100:
            mod[1].forward = lambda x: orig(x.detach())
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=130, fault=fault)


def f_forgot_zero_grad() -> list[StepRecord]:
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.02, momentum=0.9)
    return train(m, opt, _data(), steps=130,
                 fault=_at(100, lambda mod, o, loop: setattr(loop, "zero_grad", False)))


def f_forgot_zero_grad_unchecked() -> list[StepRecord]:
    # as above where grads_carried is not checked (the agent on CUDA): the grad-norm trend
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return train(m, opt, _data(), steps=160, check_carried=False,
                 fault=_at(100, lambda mod, o, loop: setattr(loop, "zero_grad", False)))


def f_update_ratio_too_large() -> list[StepRecord]:
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return train(m, opt, _data(), steps=140, fault=_at(100, lambda mod, o, l: _set_lr(o, 2.0)))


def f_initial_loss() -> list[StepRecord]:
    m = mlp()
    with torch.no_grad():
        m[4].weight.mul_(40.0)
    return train(m, torch.optim.Adam(m.parameters(), 1e-3), _data(), steps=20)


def f_loss_scale_collapse() -> list[StepRecord]:
    # from step 100 one op's backward overflows in fp16 whatever the scale
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=50)

    def fault(s: int, mod: nn.Module, o: Any, loop: Loop) -> None:
        if s == 100:
            mod[2].weight.register_hook(lambda g: g * math.inf)
    return train(m, opt, _data(), steps=130, scaler=scaler, amp_dtype=torch.float16, fault=fault)


FAULTY: list[Scenario] = [
    Scenario("nan_parameter", f_nonfinite_param, "nonfinite", 100, 0,
             description="a weight set to inf at step 100"),
    Scenario("nan_input", f_nonfinite_input, "nonfinite", 100, 0,
             description="a nan in the batch of step 100"),
    Scenario("labels_off_by_one", f_divergence_spike, "divergence_spike", 150, 3,
             description="labels shifted by one from step 150 (a bad data shard)"),
    Scenario("corrupted_batch", f_loss_spike, "loss_spike", 150, 3,
             description="4 of 64 samples of step 150's batch scaled x-20"),
    Scenario("runaway_lr", f_divergence_growth, "divergence_growth", 100, 120,
             description="lr x1.04 per step from step 100"),
    Scenario("gradient_x1000", f_exploding_gradients, "exploding_gradients", 120, 3,
             description="a backward hook scales layer 0's gradient by 1e3 from step 120"),
    Scenario("deep_sigmoid", f_vanishing_deep_sigmoid, "vanishing_gradients", 0, 10,
             description="10 sigmoid layers from the start"),
    Scenario("loss_divided_1e9", f_vanishing_scaled_loss, "vanishing_gradients", 100, 10,
             description="loss x1e-9 from step 100"),
    Scenario("dead_relu_bias", f_dead_relu, "dead_relu", 100, 10,
             description="bias of layer 2 set to -100 at step 100"),
    Scenario("saturated_tanh", f_saturated_tanh, "saturated_activation", 100, 10,
             description="first layer weights x100 at step 100 (Tanh MLP)"),
    Scenario("wrong_labels", f_plateau_wrong_labels, "plateau", 0, 100,
             description="random labels from the start (num_classes=10)"),
    Scenario("tiny_lr", f_plateau_tiny_lr_no_classes, "plateau", 0, 100, num_classes=None,
             description="SGD lr 1e-6, num_classes unknown (step-0 reference)"),
    Scenario("cyclic_lr_too_high", f_oscillation, "oscillation", 100, 60,
             description="cyclic lr peaking at 5.0 (100x) from step 100, Tanh MLP"),
    Scenario("forgot_optimizer_step", f_forgot_step, "gradients_not_applied", 100, 2,
             description="optimizer.step() no longer called from step 100"),
    Scenario("layer_not_in_optimizer", f_layer_not_in_optimizer, "gradients_not_applied", 0, 10,
             description="head replaced after the optimizer was built"),
    Scenario("detached_layer", f_missing_gradients, "missing_gradients", 100, 10,
             description="first layer's output detached from step 100"),
    Scenario("forgot_zero_grad", f_forgot_zero_grad, "forgotten_zero_grad", 100, 2,
             description="zero_grad() no longer called from step 100"),
    Scenario("forgot_zero_grad_cuda_like", f_forgot_zero_grad_unchecked, "forgotten_zero_grad",
             100, 25, description="same, grads_carried unchecked: grad-norm trend"),
    Scenario("adam_lr_2", f_update_ratio_too_large, "update_ratio", 100, 15,
             description="Adam lr 1e-3 -> 2.0 at step 100"),
    Scenario("last_layer_x40", f_initial_loss, "initial_loss", 0, 0,
             description="last layer weights x40 at init"),
    Scenario("fp16_overflow_every_step", f_loss_scale_collapse, "loss_scale_collapse", 100, 10,
             description="a backward overflows in fp16 on every step from 100"),
]


@lru_cache(maxsize=None)
def records_of(name: str) -> tuple[StepRecord, ...]:
    """Train the named scenario once per process."""
    for sc in HEALTHY + FAULTY:
        if sc.name == name:
            return tuple(sc.run())
    raise KeyError(name)


def replay_daemon(records: tuple[StepRecord, ...], num_classes: int | None,
                  config: SignatureConfig | None = None) -> list[list[Verdict]]:
    """Evaluate as the daemon does: once per new record over the last :data:`WINDOW` records,
    with ``now_s`` just after that record was written."""
    out = []
    for i in range(len(records)):
        window = records[max(0, i + 1 - WINDOW):i + 1]
        out.append(evaluate(window, config, now_s=records[i].time_s + 0.5,
                            num_classes=num_classes))
    return out


def first_fire(records: tuple[StepRecord, ...], signature: str, num_classes: int | None,
               config: SignatureConfig | None = None) -> int | None:
    """Step of the first record after which ``signature`` fired, or None."""
    for r, verdicts in zip(records, replay_daemon(records, num_classes, config)):
        if any(v.signature == signature for v in verdicts):
            return r.step
    return None
