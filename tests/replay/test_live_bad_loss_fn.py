"""``attach(loss_fn=)`` given a loss_fn that misbehaves: the training it watches must still run to the end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sentineld.agent import attach


def _raises(m, b):
    raise RuntimeError("user loss_fn broke")


def _mutates(m, b):
    with torch.no_grad():
        m[0].weight.add_(100.0)
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("bad", [_raises, lambda m, b: None,
                                 lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
                                 lambda m, b: 1.0, _mutates],
                         ids=["raises", "none", "vector", "float", "mutates"])
def test_bad_loss_fn_never_breaks_training(tmp_path: Path, bad) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = attach(model, opt, run_id="bad", runs_dir=tmp_path, metrics_port=0, loss_fn=bad, snapshot_every=5)
    t0 = time.monotonic()
    for step in range(30):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        if step == 12:
            x[0, 0] = float("nan")  # an incident: the live localizer runs the bad loss_fn
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        watch.step(loss, (x, y))
        if step == 12:
            with torch.no_grad():  # training goes on from finite weights
                for p in model.parameters():
                    p.nan_to_num_(0.0)
    watch.close()
    assert time.monotonic() - t0 < 60
    # the localizer worked on copies: the user's weights are finite and not moved by +100 in _mutates
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model[0].weight.abs().max() < 50
