"""A tiny CPU training loop that produces StepRecords the way the agent does (for signature tests).

Field semantics follow ``sentineld.agent.watch``: ``grad_norm`` is taken in the optimizer's step
pre-hook (after GradScaler unscaling and clipping), ``optimizer_skipped`` means that hook did not
run during the step, ``grads_carried`` is checked at the step's first forward (None when
accumulating, or when ``check_carried=False`` to mimic CUDA), per-layer stats come from
``sentineld.agent.probes`` every ``every`` steps. Faults are injected by a callback run at the start
of each step that may change the model, the optimizer, or the loop's knobs (:class:`Loop`).

Later the agent itself can replace :func:`train`; the scenarios only need ``list[StepRecord]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent.probes import attach_probes
from sentineld.contracts.records import StepRecord

__all__ = ["Loop", "digits", "batches", "train", "mlp", "cnn_bn", "transformer"]


@lru_cache(maxsize=1)
def _digits_np() -> tuple[Any, Any]:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    d = load_digits()
    return d.data, d.target


def digits(image: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 8x8 digits, standardised: X (1797, 64) or (1797, 1, 8, 8) float32, y (1797,) int64."""
    x_np, y_np = _digits_np()
    x = torch.tensor(x_np, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    y = torch.tensor(y_np, dtype=torch.int64)
    return (x.reshape(-1, 1, 8, 8) if image else x), y


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random minibatches (seeded)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, x.shape[0], (batch_size,), generator=g)
        yield x[idx], y[idx]


def mlp(widths: tuple[int, ...] = (64, 64, 64, 10), act: type[nn.Module] = nn.ReLU,
        seed: int = 0) -> nn.Sequential:
    """Linear/activation stack; no activation after the last Linear."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def cnn_bn(seed: int = 0) -> nn.Sequential:
    """Two conv + BatchNorm + ReLU blocks on (B, 1, 8, 8), global pooling, linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class _RowTransformer(nn.Module):
    """Digits as a sequence of 8 rows (B, 8, 8) -> embed (B, 8, 32) -> 2 encoder layers -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(1, 8, 32))
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                           activation=nn.GELU(), norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1, 8, 8)) + self.pos
        return self.head(self.norm(self.encoder(h)).mean(1))


def transformer(seed: int = 0) -> nn.Module:
    """A small pre-norm transformer encoder classifier on digit rows."""
    torch.manual_seed(seed)
    return _RowTransformer()


@dataclass
class Loop:
    """Knobs a fault callback may flip mid-run."""

    zero_grad: bool = True
    call_step: bool = True
    x_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    y_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    loss_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


Fault = Callable[[int, nn.Module, torch.optim.Optimizer, Loop], None]


def train(model: nn.Module, optimizer: torch.optim.Optimizer,
          data: Iterator[tuple[torch.Tensor, torch.Tensor]], *, steps: int,
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
          scheduler: Any = None, scaler: torch.amp.GradScaler | None = None,
          amp_dtype: torch.dtype | None = None, accum: int = 1, clip: float | None = None,
          every: int = 5, fault: Fault | None = None, check_carried: bool = True
          ) -> list[StepRecord]:
    """Train ``steps`` optimizer steps and return one StepRecord per step.

    Args:
        model, optimizer: what to train.
        data: endless (x, y) minibatches; ``accum`` of them per optimizer step.
        steps: optimizer steps.
        loss_fn: ``loss_fn(output, y) -> scalar``.
        scheduler: stepped after every optimizer step.
        scaler: a ``torch.amp.GradScaler("cpu")`` for mixed precision (with ``amp_dtype``).
        amp_dtype: autocast dtype on CPU (float16/bfloat16), or None.
        accum: micro-batches per optimizer step (declared accumulation).
        clip: clip_grad_norm_ max norm, or None.
        every: probe sampling period (steps).
        fault: ``fault(step, model, optimizer, loop)`` at the start of each step.
        check_carried: False to leave ``grads_carried`` None (as the agent does on CUDA).

    Returns:
        The records, step 0 first.
    """
    loop = Loop()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny models: one thread is faster, and immune to a busy machine
    probes = attach_probes(model, optimizer, every=every)
    state: dict[str, Any] = {"pre": False, "gnorm": None}

    def grad_norm() -> float | None:
        gs = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not gs:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                            for g in gs])))

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        state["pre"] = True
        state["gnorm"] = grad_norm()

    hook = optimizer.register_step_pre_hook(pre)
    smallest = min((p for p in model.parameters() if p.requires_grad), key=lambda p: p.numel())
    records: list[StepRecord] = []
    t_last = time.perf_counter()
    model.train()
    try:
        for step in range(steps):
            if fault is not None:
                fault(step, model, optimizer, loop)
            sampled = probes.begin_step(step)
            state["pre"], state["gnorm"] = False, None
            if loop.zero_grad:
                optimizer.zero_grad(set_to_none=True)
            carried: bool | None = None  # checked at the first forward, as the agent does
            if check_carried and accum == 1:
                carried = smallest.grad is not None and bool(smallest.grad.any())
            input_bad = False
            for _ in range(accum):
                x, y = next(data)
                if loop.x_fn is not None:
                    x = loop.x_fn(x)
                if loop.y_fn is not None:
                    y = loop.y_fn(y)
                if sampled and x.is_floating_point():
                    input_bad = input_bad or not bool(torch.isfinite(x).all())
                with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                    out = model(x)
                    loss = loss_fn(out, y) * loop.loss_scale
                loss_b = loss / accum
                (scaler.scale(loss_b) if scaler is not None else loss_b).backward()
            if scaler is not None:
                if loop.call_step:
                    scaler.unscale_(optimizer)
                    if clip is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), clip)
                    scaler.step(optimizer)
                scaler.update()
            else:
                if clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                if loop.call_step:
                    optimizer.step()
            if scheduler is not None:
                scheduler.step()
            layers = probes.collect()
            skipped = not state["pre"]
            gnorm = state["gnorm"] if state["pre"] else grad_norm()
            now = time.perf_counter()
            param_bad = None
            if sampled:
                param_bad = not all(bool(torch.isfinite(p).all()) for p in model.parameters())
            records.append(StepRecord(
                step=step, loss=float(loss.detach().float()), grad_norm=gnorm,
                lr=float(optimizer.param_groups[0]["lr"]), step_s=now - t_last,
                time_s=time.time(), optimizer_skipped=skipped,
                loss_scale=float(scaler.get_scale()) if scaler is not None else None,
                grads_carried=carried, param_nonfinite=param_bad,
                input_nonfinite=input_bad if sampled else None, layers=layers))
            t_last = now
    finally:
        hook.remove()
        probes.remove()
        torch.set_num_threads(threads)
    return records
