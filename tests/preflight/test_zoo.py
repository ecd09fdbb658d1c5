"""Every planted bug is caught by the check meant for it; healthy models get no FAIL."""

from __future__ import annotations

import warnings

import pytest
import torch

from sentineld.preflight import FAIL, PASS, check
from tests.preflight.zoo import HEALTHY, PLANTED, Case

ORDER = ["labels", "inputs", "output_vs_loss", "initial_loss", "gradient_flow", "gradients_applied",
         "shapes", "gradcheck", "dead_units", "overfit_one_batch", "heldout"]


def _run(case: Case, **kw):
    model, opt, loss_fn, batches, extra = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # mse_loss's own broadcast warning
        return check(model, opt, loss_fn, batches, **extra, **kw)


@pytest.mark.parametrize("case", PLANTED, ids=lambda c: c.name)
def test_planted_bug_is_failed_by_its_check(case: Case) -> None:
    checks = {c.name: c for c in _run(case)}
    got = checks[case.expect]
    assert got.status == FAIL, f"{case.name}: {got}"
    assert got.fix, "a FAIL must say what to do"


@pytest.mark.parametrize("case", HEALTHY, ids=lambda c: c.name)
def test_healthy_model_gets_no_fail(case: Case, tmp_path) -> None:
    result = _run(case, lr_range=True, lr_plot=tmp_path / "lr.png")
    assert [c.name for c in result] == ORDER + ["lr_range"]
    assert [c for c in result if c.status == FAIL] == []
    lr = result[-1].evidence
    assert lr["suggested_lr"] is not None and lr["suggested_lr"] <= lr["min_loss_lr"] / 10
    overfit = {c.name: c for c in result}["overfit_one_batch"]
    assert overfit.status == PASS and overfit.evidence["final_loss"] <= 0.01 * overfit.evidence["first_loss"]


def test_too_high_lr_is_failed_by_the_lr_range_test_too(tmp_path) -> None:
    case = next(c for c in PLANTED if c.name == "too_high_lr")
    lr = {c.name: c for c in _run(case, lr_range=True, lr_plot=tmp_path / "lr.svg")}["lr_range"]
    assert lr.status == FAIL
    assert lr.evidence["diverges_at_lr"] < lr.evidence["your_lr"] == 30.0
    assert lr.evidence["suggested_lr"] < lr.evidence["diverges_at_lr"]
    assert (tmp_path / "lr.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_healthy_lr_range_suggests_a_working_lr(tmp_path) -> None:
    model, opt, loss_fn, batches, _ = HEALTHY[0].build()
    lr = {c.name: c for c in check(model, opt, loss_fn, batches, lr_range=True,
                                   lr_plot=tmp_path / "lr.png")}["lr_range"]
    assert lr.status == PASS
    suggested = lr.evidence["suggested_lr"]
    assert 1e-4 < suggested < 1.0
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the suggestion is a learning rate that trains: Adam at it overfits the batch
    model, _, loss_fn, batches, _ = HEALTHY[0].build()
    opt = torch.optim.Adam(model.parameters(), lr=suggested)
    x, y = batches[0]
    first = float(loss_fn(model, (x, y)).detach())
    for _ in range(100):
        opt.zero_grad()
        loss = loss_fn(model, (x, y))
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.1 * first


def test_off_by_one_labels_name_the_range_even_though_the_loss_raises() -> None:
    case = next(c for c in PLANTED if c.name == "labels_off_by_one")
    checks = {c.name: c for c in _run(case)}
    assert "[1, 5]" in checks["labels"].message and "0..4" in checks["labels"].message
    assert "IndexError" in checks["overfit_one_batch"].message
