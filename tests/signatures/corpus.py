"""The healthy-run corpus (issue 21): real short torch training recorded through the real agent.

Each :class:`Run` is a plain training loop of a different kind (converged to ~0, label noise,
warm-up + cosine, fine-tuning at a small lr, clipping, BatchNorm CNN, AdamW with decay, a small
causal transformer LM, bf16 autocast, fp16 + GradScaler, SGD momentum, batch sizes from 4 to
512, ...), watched by ``sentineld.agent.attach`` into a run directory; the tests read the run's
stream back (as the daemon does) and run the daemon's chain (:mod:`tests.signatures.chain`) over
it. A run with ``fault`` set is a planted fault on the same recipe: its signature must still
fire (the floors must not blind the rules). The Lightning and Hugging Face runs are in
:mod:`tests.signatures.corpus_frameworks` (a subprocess: one import of each framework).

Runs are tiny (CPU, 100-160 steps, one thread); :func:`record_all` trains every run once into a
directory and returns the records.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.records import StepRecord, record_from_json
from sentineld.contracts.stream import read_stream
from tests.signatures.corpus_parts import (
    GRUClassifier,
    TinyLM,
    _adam,
    _digits,
    _fixed,
    _lm_loss,
    _noisy_labels,
    _regression,
    _seeded,
    _stream,
    _text,
    _warmup_cosine,
)
from tests.signatures.harness import cnn_bn, digits, mlp, transformer

__all__ = ["Run", "RUNS", "HEALTHY_RUNS", "FAULT_RUNS", "record", "record_all", "read_records"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Run:
    """One corpus run: what to build and how to train it.

    Attributes:
        name: run id.
        build: ``seed -> (model, optimizer, scheduler or None, batches)``.
        steps: optimizer steps.
        num_classes: given to ``attach`` (run.json), as a user would; None for regressions.
        loss_fn: ``(output, y) -> loss``.
        amp: autocast dtype, or None; scaler: fp16 GradScaler.
        accum: micro-batches per step; clip: ``clip_grad_norm_`` max norm (told to the agent).
        fault: ``(step, model, optimizer, state) -> None`` at each step's start, or None.
        expect: the signature the fault must raise (None for healthy runs).
        kind: what this run stands for in the corpus.
        resolves: the fault's own signature may resolve while the fault lasts (an update ratio
            above 1 falls by itself on the next samples as the weights blow up).
    """

    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Any, Iterator[Batch]]]
    steps: int = 150
    num_classes: int | None = 10
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    amp: torch.dtype | None = None
    scaler: bool = False
    accum: int = 1
    clip: float | None = None
    fault: Callable[[int, nn.Module, torch.optim.Optimizer, dict[str, Any]], None] | None = None
    expect: str | None = None
    kind: str = ""
    resolves: bool = False


# ----------------------------------------------------------------------------- data
def b_memorise_adam() -> Any:  # issue 21's converging run: loss to ~0 (1e-8 and below)
    m = _seeded(0, lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    return m, _adam(m, 0.05), None, _fixed(16, 20, 4, 0)


def b_memorise_8() -> Any:  # 8 samples: loss exactly 0 in float32
    m = _seeded(1, lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    return m, _adam(m, 0.05), None, _fixed(8, 20, 4, 1)


def b_memorise_sgd() -> Any:
    m = _seeded(2, lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    return m, torch.optim.SGD(m.parameters(), 0.5, momentum=0.9), None, _fixed(32, 20, 4, 2)


def b_overfit_digits_batch() -> Any:
    x, y = digits()

    def one() -> Iterator[Batch]:
        while True:
            yield x[:32], y[:32]
    m = mlp(seed=3)
    return m, _adam(m, 3e-3), None, one()


def b_label_noise_20() -> Any:
    m = mlp(seed=4)
    return m, _adam(m), None, _noisy_labels(0.2, 4)


def b_label_noise_50() -> Any:
    m = mlp(seed=5)
    return m, _adam(m), None, _noisy_labels(0.5, 5)


def b_warmup_cosine_adamw() -> Any:
    m = mlp(seed=6)
    opt = torch.optim.AdamW(m.parameters(), 3e-3, weight_decay=0.01)
    return m, opt, _warmup_cosine(opt, 15, 150), _digits(seed=6)


def b_finetune_small_lr() -> Any:
    # pretrained (100 steps at lr 1e-3, not watched), then fine-tuned at lr 1e-5 under the agent
    m = mlp(seed=7)
    opt = _adam(m)
    data = _digits(seed=7)
    for _ in range(100):
        x, y = next(data)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return m, _adam(m, 1e-5), None, data


def b_clip_transformer() -> Any:
    m = transformer(seed=8)
    opt = torch.optim.AdamW(m.parameters(), 2e-3, weight_decay=0.01)
    return m, opt, _warmup_cosine(opt, 15, 120), _digits(batch=32, seed=8)


def b_clip_tight_sgd() -> Any:  # clips at 0.1: nearly every step clipped
    m = mlp(seed=9)
    return m, torch.optim.SGD(m.parameters(), 0.5, momentum=0.9), None, _digits(seed=9)


def b_cnn_batchnorm() -> Any:
    m = cnn_bn(seed=10)
    return m, torch.optim.SGD(m.parameters(), 0.1, momentum=0.9), None, _digits(image=True, seed=10)


def b_adamw_decay() -> Any:
    m = mlp(seed=11)
    return m, torch.optim.AdamW(m.parameters(), 2e-3, weight_decay=0.1), None, _digits(seed=11)


def b_tiny_lm() -> Any:
    m = _seeded(12, TinyLM)
    opt = torch.optim.AdamW(m.parameters(), 3e-3, weight_decay=0.01)
    return m, opt, _warmup_cosine(opt, 15, 120), _text(seed=12)


def b_bf16() -> Any:
    m = mlp(widths=(64, 128, 128, 10), act=nn.SiLU, seed=13)
    return m, _adam(m, 2e-3), None, _digits(seed=13)


def b_fp16_gradscaler() -> Any:
    m = mlp(seed=14)
    return m, _adam(m), None, _digits(seed=14)


def b_sgd_momentum() -> Any:
    m = mlp(seed=15)
    return m, torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, weight_decay=1e-4), None, _digits(seed=15)


def b_sgd_nesterov() -> Any:
    m = mlp(seed=16)
    return m, torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, nesterov=True), None, _digits(seed=16)


def _batch_size(batch: int, lr: float, seed: int) -> Callable[[], Any]:
    def build() -> Any:
        m = mlp(seed=seed)
        return m, _adam(m, lr), None, _digits(batch=batch, seed=seed)
    build.__name__ = f"b_batch_{batch}"
    return build


def b_accumulate_4() -> Any:
    m = mlp(seed=20)
    return m, _adam(m), None, _digits(batch=16, seed=20)


def b_tanh() -> Any:
    m = mlp(act=nn.Tanh, seed=21)
    return m, _adam(m), None, _digits(seed=21)


def b_sigmoid_bce() -> Any:
    x, y = digits()
    m = _seeded(22, lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid()))
    return m, _adam(m, 3e-3), None, _stream(x, (y >= 5).float().unsqueeze(1), 64, 22)


def b_residual_layernorm() -> Any:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64)
            self.fc = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.fc(self.norm(h))
    m = _seeded(23, lambda: nn.Sequential(nn.Linear(64, 64), *[Block() for _ in range(3)],
                                          nn.LayerNorm(64), nn.Linear(64, 10)))
    return m, torch.optim.AdamW(m.parameters(), 1e-3), None, _digits(seed=23)


def b_dropout_steplr() -> Any:
    m = _seeded(24, lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10)))
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, 100, gamma=0.1), _digits(seed=24)


def b_regression_mse() -> Any:
    m = _seeded(25, lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    return m, _adam(m, 3e-3), None, _regression(25)


def b_rmsprop() -> Any:
    m = mlp(seed=26)
    return m, torch.optim.RMSprop(m.parameters(), 1e-3), None, _digits(seed=26)


def b_adagrad() -> Any:
    m = mlp(seed=27)
    return m, torch.optim.Adagrad(m.parameters(), 0.05), None, _digits(seed=27)


def b_onecycle() -> Any:
    # Peak lr 0.1. At a peak of 0.2 (momentum 0.9) this run's step 81 reaches a loss of 4.45 from a
    # trailing median of 0.53, grad norm 9.8 (2x anything in its window): worse than the untrained
    # model's ln 10 = 2.30 for one step. That is a real loss spike, which `loss_spike` rightly
    # reports, not a healthy run to stay silent on.
    m = mlp(seed=28)
    opt = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9)
    return m, opt, torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=150), _digits(seed=28)


def b_linear_decay_to_zero() -> Any:
    m = mlp(seed=29)
    opt = _adam(m, 2e-3)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 150)), _digits(seed=29)


def b_gru() -> Any:
    m = _seeded(31, GRUClassifier)
    return m, _adam(m, 3e-3), None, _digits(seed=31)


def b_label_smoothing() -> Any:
    m = mlp(seed=32)
    return m, _adam(m, 2e-3), None, _digits(seed=32)


def b_deep_kaiming() -> Any:
    def make() -> nn.Module:
        net = mlp(widths=(64,) + (64,) * 7 + (10,), seed=33)
        for mod in net:
            if isinstance(mod, nn.Linear):
                nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
                nn.init.zeros_(mod.bias)
        return net
    m = make()
    return m, _adam(m, 5e-4), None, _digits(seed=33)


def b_nadam_high_lr() -> Any:
    m = mlp(seed=34)
    return m, torch.optim.NAdam(m.parameters(), 1e-2), None, _digits(seed=34)


def b_cnn_no_norm_adam() -> Any:
    m = _seeded(35, lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                          nn.Linear(16 * 16, 10)))
    return m, _adam(m), None, _digits(image=True, seed=35)


def _smooth(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, label_smoothing=0.1)


def _frozen_opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in m.parameters() if p.requires_grad], 1e-3)


def b_frozen_first_layer_opt() -> Any:
    m = mlp(seed=30)
    m[0].requires_grad_(False)
    return m, _frozen_opt(m), None, _digits(seed=30)


# ----------------------------------------------------------------------------- planted faults
def _at(step: int, action: Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]], None]) -> Any:
    def fault(s: int, m: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if s == step:
            with torch.no_grad():
                action(m, opt, state)
    return fault


def _lr(value: float) -> Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]], None]:
    def act(m: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        for g in opt.param_groups:
            g["lr"] = value
    return act


def _explode(m: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    first = next(p for p in m.parameters() if p.requires_grad)
    first.register_hook(lambda g: g * 1e3)


HEALTHY_RUNS: list[Run] = [
    Run("memorise_adam_to_1e-8", b_memorise_adam, num_classes=4, kind="converged to ~0 (issue 21's run)"),
    Run("memorise_8_loss_0", b_memorise_8, num_classes=4, kind="converged to exactly 0"),
    Run("memorise_sgd", b_memorise_sgd, num_classes=4, kind="converged, SGD momentum"),
    Run("overfit_digits_batch", b_overfit_digits_batch, kind="the method's overfit-one-batch check"),
    Run("label_noise_20", b_label_noise_20, kind="20% random labels"),
    Run("label_noise_50", b_label_noise_50, kind="50% random labels"),
    Run("warmup_cosine_adamw", b_warmup_cosine_adamw, kind="warm-up + cosine"),
    Run("finetune_lr_1e-5", b_finetune_small_lr, kind="fine-tuning at a small lr"),
    Run("clip_transformer", b_clip_transformer, clip=1.0, steps=120, kind="clipping at 1.0, transformer"),
    Run("clip_0.1_sgd", b_clip_tight_sgd, clip=0.1, kind="clipping on nearly every step"),
    Run("cnn_batchnorm", b_cnn_batchnorm, kind="BatchNorm CNN"),
    Run("adamw_decay_0.1", b_adamw_decay, kind="AdamW with decay"),
    Run("tiny_causal_lm", b_tiny_lm, steps=120, num_classes=16, loss_fn=_lm_loss, kind="small transformer LM"),
    Run("bf16_autocast", b_bf16, amp=torch.bfloat16, kind="bf16 autocast"),
    Run("fp16_gradscaler", b_fp16_gradscaler, amp=torch.float16, scaler=True, kind="fp16 + GradScaler"),
    Run("sgd_momentum", b_sgd_momentum, kind="SGD momentum + weight decay"),
    Run("sgd_nesterov", b_sgd_nesterov, kind="SGD Nesterov"),
    Run("batch_4", _batch_size(4, 1e-3, 17), kind="batch size 4"),
    Run("batch_32", _batch_size(32, 1e-3, 18), kind="batch size 32"),
    Run("batch_512", _batch_size(512, 3e-3, 19), steps=100, kind="batch size 512"),
    Run("accumulate_4", b_accumulate_4, accum=4, steps=100, kind="4 micro-batches per step"),
    Run("tanh_mlp", b_tanh, kind="Tanh MLP"),
    Run("sigmoid_bce", b_sigmoid_bce, num_classes=2, loss_fn=F.binary_cross_entropy, kind="Sigmoid + BCE"),
    Run("residual_layernorm", b_residual_layernorm, kind="residual GELU + LayerNorm"),
    Run("dropout_steplr", b_dropout_steplr, kind="dropout, StepLR x0.1 at 100"),
    Run("regression_mse", b_regression_mse, num_classes=None, loss_fn=F.mse_loss, kind="regression (MSE)"),
    Run("rmsprop", b_rmsprop, kind="RMSprop"),
    Run("adagrad", b_adagrad, kind="Adagrad"),
    Run("onecycle", b_onecycle, kind="OneCycleLR"),
    Run("linear_decay_to_0", b_linear_decay_to_zero, kind="lr decayed linearly to 0"),
    Run("frozen_first_layer", b_frozen_first_layer_opt, kind="frozen first layer (not in the optimizer)"),
    Run("gru", b_gru, kind="GRU sequence classifier"),
    Run("label_smoothing", b_label_smoothing, loss_fn=_smooth, kind="label smoothing 0.1 (loss floor > 0)"),
    Run("deep_kaiming", b_deep_kaiming, kind="8-layer ReLU MLP, Kaiming init"),
    Run("nadam_lr_1e-2", b_nadam_high_lr, kind="NAdam at a high lr"),
    Run("cnn_no_norm", b_cnn_no_norm_adam, kind="CNN without normalisation"),
]

FAULT_RUNS: list[Run] = [
    Run("memorise_adam.fault_loss_1e-9", b_memorise_adam, num_classes=4, steps=140, expect="vanishing_gradients",
        fault=lambda s, m, o, st: st.__setitem__("loss_scale", 1e-9 if s >= 3 else 1.0),
        kind="issue 21's run, its loss divided by 1e9 from step 3"),
    Run("clip_transformer.fault_explode", b_clip_transformer, clip=1.0, steps=120, expect="exploding_gradients",
        fault=_at(80, _explode), kind="clipped at 1.0, a gradient x1e3 from step 80"),
    Run("label_noise_20.fault_random_labels", b_label_noise_20, steps=160, expect="plateau",
        fault=_at(0, lambda m, o, st: st.__setitem__("random_labels", True)), kind="every label random"),
    Run("adamw_decay.fault_lr_2", b_adamw_decay, steps=140, expect="update_ratio", resolves=True,
        fault=_at(100, _lr(2.0)), kind="lr 2e-3 -> 2.0 at step 100"),
    Run("memorise_adam.fault_nan", b_memorise_adam, num_classes=4, steps=120, expect="nonfinite",
        fault=_at(100, lambda m, o, st: m[0].weight.__setitem__((0, 0), math.nan)),
        kind="converged run, a NaN weight at step 100"),
    Run("warmup_cosine.fault_labels_shifted", b_warmup_cosine_adamw, steps=130, expect="divergence_spike",
        fault=_at(100, lambda m, o, st: st.__setitem__("shift_labels", True)),
        kind="labels off by one from step 100"),
]

RUNS = HEALTHY_RUNS + FAULT_RUNS


# ----------------------------------------------------------------------------- recording
def record(run: Run, runs_dir: Path) -> Path:
    """Train ``run`` under the agent into ``runs_dir``; returns its run directory."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and immune to a busy machine
    try:
        model, opt, sched, data = run.build()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=50) if run.scaler else None
        watch = attach(model, opt, run_id=run.name, runs_dir=runs_dir, metrics_port=0, localize="off",
                       num_classes=run.num_classes, scheduler=sched, scaler=scaler,
                       accumulation_steps=run.accum, clip_grad_norm=run.clip)
        state: dict[str, Any] = {"loss_scale": 1.0}
        model.train()
        for step in range(run.steps):
            if run.fault is not None:
                run.fault(step, model, opt, state)
            opt.zero_grad(set_to_none=True)
            micro = []
            for _ in range(run.accum):
                x, y = next(data)
                if state.get("random_labels"):
                    y = torch.randint(0, 10, y.shape)
                if state.get("shift_labels"):
                    y = (y + 1) % 10
                with torch.autocast("cpu", dtype=run.amp, enabled=run.amp is not None):
                    loss = run.loss_fn(model(x), y) * state["loss_scale"]
                scaled = loss / run.accum
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                micro.append((x, y))
            if scaler is not None:
                scaler.unscale_(opt)
            if run.clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), run.clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if sched is not None:
                sched.step()
            watch.step(loss, micro if run.accum > 1 else micro[0])
        watch.close()
        return Path(watch.run_dir)
    finally:
        torch.set_num_threads(threads)


def read_records(run_dir: Path) -> list[StepRecord]:
    """The step records of a run's rank-0 stream, as the daemon reads them."""
    objs, _, _ = read_stream(run_dir / "stream-rank0.jsonl")
    return [record_from_json(o) for o in objs if o.get("kind") == "step"]


def record_all(runs: list[Run], runs_dir: Path) -> dict[str, tuple[list[StepRecord], float]]:
    """Record every run; ``name -> (records, seconds it took)``."""
    out = {}
    for run in runs:
        t = time.perf_counter()
        out[run.name] = (read_records(record(run, runs_dir)), time.perf_counter() - t)
    return out
