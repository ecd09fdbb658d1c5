"""Recipes for tests/agent/test_first_steps.py: an optimizer whose rescale is 0/0 at one step.

``BadRescale`` is SGD whose update is multiplied by ``num / num``; ``num`` is 0 at ``bad_step``, so
that step's update is nan while its loss and gradients are finite: the fault is made in the
optimizer step and first shows in the next step's loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sentineld.contracts.recipe import Recipe


class BadRescale(torch.optim.Optimizer):
    """SGD with a per-step rescale of the update that is 0/0 at step ``bad_step``."""

    def __init__(self, params: Any, lr: float = 0.1, bad_step: int = 0) -> None:
        super().__init__(params, {"lr": lr, "bad_step": bad_step})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                n = int(state.get("n", 0))
                num = torch.zeros(()) if n == group["bad_step"] else torch.ones(())
                p.add_(p.grad * (num / num), alpha=-group["lr"])
                state["n"] = n + 1


class MethodNet(torch.nn.Module):
    """A model whose loop calls ``training_loss``, never ``forward`` (no forward pre-hook fires)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def training_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.relu(self.a(x))), y)


def make(bad_step: int = 0) -> Recipe:
    torch.manual_seed(0)
    model = MethodNet()
    return Recipe(model=model, optimizer=BadRescale(model.parameters(), 0.1, bad_step),
                  loss_fn=lambda m, b: m.training_loss(*b))
