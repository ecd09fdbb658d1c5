"""Recipe.scale_accumulated: the HF Trainer does not divide a micro-batch's loss by the
accumulation steps when the model normalizes it itself (num_items_in_batch); train_step must
then backpropagate each loss as it is."""

from __future__ import annotations

import torch

from sentineld.contracts.recipe import Recipe, train_step


def _grads(scale_accumulated: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights alone
    rec = Recipe(model=model, optimizer=opt, loss_fn=lambda m, b: m(b).sum(), accumulation_steps=2,
                 scale_accumulated=scale_accumulated)
    batches = [torch.ones(2, 3), torch.full((2, 3), 2.0)]
    train_step(rec, batches)
    return model.weight.grad.clone()


def test_accumulated_losses_are_divided_by_default_and_not_when_told() -> None:
    # d/dw of sum(x @ w) over both micro-batches: 2*1 + 2*2 = 6 per weight.
    assert torch.equal(_grads(scale_accumulated=False), torch.full((1, 3), 6.0))
    assert torch.equal(_grads(scale_accumulated=True), torch.full((1, 3), 3.0))
