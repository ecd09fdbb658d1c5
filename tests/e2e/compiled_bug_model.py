"""A model whose fault only inductor makes: importing this module switches on inductor's own
testing knob ``cpp.inject_relu_bug_TESTING_ONLY = "accuracy"`` (its C++ relu computes ``x + 1``),
so ``sqrt(0.25 - relu(h))`` with ``h <= 0`` is 0.5 eagerly and NaN compiled. It stands in for a
real compiler bug in the minifier test (tests/e2e/test_compiled_replay.py); the recipe module is
what the replay's compiled re-run imports, so the knob is on there too.
"""

from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import nn

from sentineld.recipe import Recipe

inductor_config.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"


class Bugged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = -self.fc(x).abs()  # <= 0: eager relu gives 0
        return torch.sqrt(0.25 - torch.relu(h)) * self.fc.weight.sum()


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch[0]).mean()


def make_recipe() -> Recipe:
    torch.manual_seed(0)
    model = Bugged()
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2), loss_fn=loss_fn)
