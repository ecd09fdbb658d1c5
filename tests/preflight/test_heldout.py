"""Issue 22: labels permuted within each batch passed every preflight check on 49179bb (one batch
is memorised); the held-out check warns on them and passes the same data with its real labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.preflight import check


def _batches(shuffle: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    out = []
    for _ in range(8):
        x = torch.randn(32, 10, generator=g)
        y = (x @ w).argmax(1)  # the labels follow from the inputs
        if shuffle:
            y = y[torch.randperm(32, generator=g)]  # ... until a bad collate permutes them in the batch
        out.append((x, y))
    return out


def _run(shuffle: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    checks = check(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]), _batches(shuffle), num_classes=4)
    return {c.name: c for c in checks}


def test_shuffled_labels_fail_the_heldout_check_real_labels_pass() -> None:
    bad = _run(shuffle=True)
    assert bad["heldout"].status == "WARN", bad["heldout"]  # never PASS (random-label smoke data warns too)
    assert bad["overfit_one_batch"].status != "FAIL"  # what let it through before
    good = _run(shuffle=False)
    assert good["heldout"].status == "PASS", good["heldout"]
    assert good["heldout"].evidence["heldout_loss"] < good["heldout"].evidence["baseline_loss"]
