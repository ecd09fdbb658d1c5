"""Planted bugs and healthy models for ``sentineld preflight`` (shared by the tests and bench/).

Every case is a tiny real model trained with a real optimizer on seeded synthetic data whose
labels are a function of the inputs (so one batch can be overfit). A planted case names the
check meant to catch it (``expect``); a healthy case has ``expect=None`` and must get no FAIL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Case", "CASES", "HEALTHY", "PLANTED", "build"]

C, D, B, NB = 5, 20, 32, 4  # classes, features, batch size, batches


@dataclass
class Case:
    """One zoo entry: ``build()`` -> (model, optimizer, loss_fn, batches, extra kwargs for check)."""

    name: str
    expect: str | None
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable, list[Any], dict[str, Any]]]
    note: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tabular(seed: int = 0, scale: float = 1.0, shift: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """NB batches of (x [B, D] float, y [B] long in 0..C-1); y = argmax(x @ W)."""
    g = _gen(seed)
    w = torch.randn(D, C, generator=g)
    out = []
    for _ in range(NB):
        x = torch.randn(B, D, generator=g)
        out.append((x * scale + shift, (x @ w).argmax(1)))
    return out


def images(seed: int = 0, raw: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """NB batches of (x [B, 1, 8, 8], y [B]); y = which quadrant is brightest (4 classes)."""
    g = _gen(seed)
    out = []
    for _ in range(NB):
        x = torch.rand(B, 1, 8, 8, generator=g)
        q = torch.stack([x[:, 0, :4, :4].mean((1, 2)), x[:, 0, :4, 4:].mean((1, 2)),
                         x[:, 0, 4:, :4].mean((1, 2)), x[:, 0, 4:, 4:].mean((1, 2))], 1)
        y = q.argmax(1)
        x = (x * 255).round() if raw else (x - 0.5) / 0.29
        out.append((x, y))
    return out


def tokens(seed: int = 0, vocab: int = 16, length: int = 8) -> list[dict[str, torch.Tensor]]:
    """NB dict batches {"input_ids": [B, T] long, "labels": [B, T] long}; labels = (ids + 1) % V."""
    g = _gen(seed)
    out = []
    for _ in range(NB):
        ids = torch.randint(0, vocab, (B, length), generator=g)
        out.append({"input_ids": ids, "labels": (ids + 1) % vocab})
    return out


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp(out: int = C, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 64), act(), nn.Linear(64, out))


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 64, 4))


class TinyLM(nn.Module):
    """Embedding + learned positions + one Transformer encoder layer + vocabulary head."""

    def __init__(self, vocab: int = 16, dim: int = 32, length: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids) + self.pos))


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


class Square(torch.autograd.Function):
    """x**2 with a hand-written backward; ``broken`` returns x instead of 2x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.broken = broken
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (x if ctx.broken else 2 * x), None


class SquareNet(nn.Module):
    def __init__(self, broken: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.broken = nn.Linear(D, 64), nn.Linear(64, C), broken

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(Square.apply(self.fc1(x) * 0.5, self.broken))


def _adam(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


# ------------------------------------------------------------------ healthy
def healthy_mlp():
    m = mlp()
    return m, _adam(m), ce, tabular(), {}


def healthy_cnn_bn():
    m = cnn()
    return m, _adam(m), ce, images(), {}


def healthy_tiny_lm():
    m = TinyLM()
    return m, _adam(m, 3e-3), lm_loss, tokens(), {}


def healthy_regression():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 32), nn.Tanh(), nn.Linear(32, 1))
    data = [(x, x[:, :3].sum(1, keepdim=True)) for x, _ in tabular()]
    return m, _adam(m), lambda model, b: F.mse_loss(model(b[0]), b[1]), data, {}


def healthy_custom_function():
    m = SquareNet(broken=False)
    return m, _adam(m), ce, tabular(), {}


class GRUClassifier(nn.Module):
    """Embedding + GRU + head on the last step (3 classes: last token id mod 3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.gru, self.head = nn.Embedding(16, 16), nn.GRU(16, 32, batch_first=True), nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(ids))[0][:, -1])


def healthy_gru():
    g = _gen(0)
    data = []
    for _ in range(NB):
        ids = torch.randint(0, 16, (B, 6), generator=g)
        data.append((ids, ids[:, -1] % 3))
    m = GRUClassifier()
    return m, _adam(m), ce, data, {}


def healthy_layernorm_gelu_dropout():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64),
                      nn.LayerNorm(64), nn.GELU(), nn.Linear(64, C))
    return m, _adam(m, 1e-3), ce, tabular(), {}


def healthy_cnn_sgd_momentum():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), ce, images(), {}


def healthy_binary_logits():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, 1))
    data = [(x, (y % 2).float()) for x, y in tabular()]
    return m, _adam(m), lambda model, b: F.binary_cross_entropy_with_logits(model(b[0]).squeeze(1), b[1]), data, {}


# ------------------------------------------------------------------ planted
def one_class_labels():
    m = mlp()
    return m, _adam(m), ce, [(x, torch.zeros_like(y)) for x, y in tabular()], {}


def labels_off_by_one():
    m = mlp()
    return m, _adam(m), ce, [(x, y + 1) for x, y in tabular()], {}  # C read off the loss


def raw_pixels():
    m = cnn()
    return m, _adam(m), ce, images(raw=True), {}


def unscaled_features():
    m = mlp()
    return m, _adam(m), ce, tabular(scale=300.0, shift=1000.0), {}


def double_softmax():
    m = nn.Sequential(*mlp(), nn.Softmax(dim=1))
    return m, _adam(m), ce, tabular(), {}


def nll_of_probabilities():
    m = nn.Sequential(*mlp(), nn.Softmax(dim=1))
    return m, _adam(m), lambda model, b: F.nll_loss(model(b[0]), b[1]), tabular(), {}


def sigmoid_into_bce_with_logits():
    m = nn.Sequential(*mlp(out=1), nn.Sigmoid())
    data = [(x, (y % 2).float().unsqueeze(1)) for x, y in tabular()]
    return m, _adam(m), lambda model, b: F.binary_cross_entropy_with_logits(model(b[0]), b[1]), data, {}


def bad_last_layer_scale():
    m = mlp()
    with torch.no_grad():
        m[2].weight.mul_(60.0)
    return m, _adam(m), ce, tabular(), {}


def frozen_layer():
    m = mlp()
    opt = _adam(m)
    m[0].requires_grad_(False)  # frozen after the optimizer was built over it
    return m, opt, ce, tabular(), {}


def missing_from_optimizer():
    m = mlp()
    return m, torch.optim.Adam(m[2].parameters(), lr=1e-2), ce, tabular(), {}


def forgot_zero_grad():
    m = mlp()

    def step(model, opt, batch):
        loss = ce(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()
    return m, torch.optim.SGD(m.parameters(), lr=0.05), ce, tabular(), {"step": step}


def forgot_optimizer_step():
    m = mlp()

    def step(model, opt, batch):
        opt.zero_grad()
        loss = ce(model, batch)
        loss.backward()
        return loss.detach()
    return m, _adam(m), ce, tabular(), {"step": step}


def broken_custom_backward():
    m = SquareNet(broken=True)
    return m, _adam(m), ce, tabular(), {}


def broadcasting_loss():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 32), nn.Tanh(), nn.Linear(32, 1))
    data = [(x, x[:, :3].sum(1)) for x, _ in tabular()]  # target [B] against output [B, 1]
    return m, _adam(m), lambda model, b: F.mse_loss(model(b[0]), b[1]), data, {}


def dead_relu_init():
    m = mlp()
    with torch.no_grad():
        m[0].bias.fill_(-10.0)
    return m, _adam(m), ce, tabular(), {}


def too_high_lr():
    m = mlp()
    return m, torch.optim.SGD(m.parameters(), lr=30.0), ce, tabular(), {}


HEALTHY = [Case("mlp", None, healthy_mlp), Case("cnn_bn", None, healthy_cnn_bn),
           Case("tiny_lm", None, healthy_tiny_lm), Case("regression_tanh", None, healthy_regression),
           Case("custom_function_ok", None, healthy_custom_function), Case("gru", None, healthy_gru),
           Case("layernorm_gelu_dropout", None, healthy_layernorm_gelu_dropout),
           Case("cnn_sgd_momentum", None, healthy_cnn_sgd_momentum),
           Case("binary_logits", None, healthy_binary_logits)]
PLANTED = [Case("one_class_labels", "labels", one_class_labels),
           Case("labels_off_by_one", "labels", labels_off_by_one),
           Case("raw_pixels", "inputs", raw_pixels),
           Case("unscaled_features", "inputs", unscaled_features),
           Case("double_softmax", "output_vs_loss", double_softmax),
           Case("nll_of_probabilities", "output_vs_loss", nll_of_probabilities),
           Case("sigmoid_into_bce_with_logits", "output_vs_loss", sigmoid_into_bce_with_logits),
           Case("bad_last_layer_scale", "initial_loss", bad_last_layer_scale),
           Case("frozen_layer", "gradient_flow", frozen_layer),
           Case("missing_from_optimizer", "gradient_flow", missing_from_optimizer),
           Case("forgot_zero_grad", "gradients_applied", forgot_zero_grad),
           Case("forgot_optimizer_step", "gradients_applied", forgot_optimizer_step),
           Case("broadcasting_loss", "shapes", broadcasting_loss),
           Case("broken_custom_backward", "gradcheck", broken_custom_backward),
           Case("dead_relu_init", "dead_units", dead_relu_init),
           Case("too_high_lr", "overfit_one_batch", too_high_lr)]
CASES = HEALTHY + PLANTED


def build(case: Case) -> tuple[nn.Module, torch.optim.Optimizer, Callable, list[Any], dict[str, Any]]:
    """Build a case's objects (deterministic: every builder seeds torch)."""
    return case.build()
