"""The demo's model, data and planted faults (scikit-learn's bundled 8x8 handwritten digits).

Faults:
- ``none``: trains cleanly (Adam, lr 1e-3) to > 90% test accuracy.
- ``lr``: SGD with a learning rate far too high (the method's first NaN cause): weights blow up
  until a Linear layer's output overflows.
- ``zero-std``: a hand-written normalization layer divides by the batch standard deviation; the
  digits data has pixels that are 0 in every image (the corners), so std = 0 and 0/0 = NaN.

:func:`make_recipe` is the run's recipe: the replay imports it to rebuild model and loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe

__all__ = ["FAULTS", "Standardize", "DigitsNet", "load_digits_tensors", "make_recipe", "loss_fn"]

FAULTS = ("none", "lr", "zero-std")


class Standardize(nn.Module):
    """Hand-written per-feature standardization over the batch: ``(x - mean) / std``.

    With ``eps=0`` (the planted fault) a feature that is constant over the batch gives 0/0 = NaN.
    Input and output shape ``(B, F)``.
    """

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0, keepdim=True)
        std = x.std(dim=0, keepdim=True)
        return (x - mean) / (std + self.eps)


class DigitsNet(nn.Module):
    """MLP for 8x8 digits: (B, 64) pixels in [0, 16] -> (B, 10) logits."""

    def __init__(self, eps: float = 1e-5, hidden: int = 128) -> None:
        super().__init__()
        self.norm = Standardize(eps)
        self.fc1 = nn.Linear(64, hidden)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(self.norm(x))))))


def load_digits_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as float tensors, split 80/20: ``(x_train (N, 64), y_train (N,), x_test, y_test)``."""
    from sklearn.datasets import load_digits  # noqa: PLC0415 - only the demo needs scikit-learn

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    return x[:n], y[:n], x[n:], y[n:]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y`` for ``batch = (x (B, 64), y (B,))``."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_recipe(fault: str = "none", seed: int = 0) -> Recipe:
    """Model, optimizer and loss for ``fault``.

    Raises:
        ValueError: unknown fault (the message lists the known ones).
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    torch.manual_seed(seed)
    model = DigitsNet(eps=0.0 if fault == "zero-std" else 1e-5)
    if fault == "lr":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=50.0, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Recipe(model=model, optimizer=opt, loss_fn=loss_fn, num_classes=10)
