"""The checks one by one, on inputs chosen at their boundaries."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sentineld.preflight import FAIL, PASS, SKIP, WARN, Check, check, to_json_dict
from sentineld.preflight.context import slice_batch, split_batch
from sentineld.preflight.grad_checks import check_gradcheck
from sentineld.preflight.loss_checks import INIT_LOSS_PASS, check_initial_loss, check_output_vs_loss, check_shapes
from sentineld.preflight.lossinfo import LossInfo
from sentineld.preflight.trace import Trace, trace_forward
from sentineld.preflight.units import unit_inactive
from tests.preflight.zoo import tabular


class Head(nn.Module):
    def __init__(self, post: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.post = nn.Linear(20, 5), post

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.fc(x))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _trace(post: Any, loss_fn: Any = _ce) -> Trace:
    return trace_forward(Head(post), loss_fn, tabular()[0])


def test_softmax_seen_through_reshapes_is_double_softmax() -> None:
    c = check_output_vs_loss(_trace(lambda z: torch.softmax(z, 1).reshape(32, 5).contiguous()))
    assert c.status == FAIL and c.evidence["ops"].startswith("_softmax") and "_log_softmax" in c.evidence["ops"]


def test_manual_log_of_softmax_into_nll_is_fine() -> None:
    loss = lambda m, b: F.nll_loss(torch.log(m(b[0])), b[1])  # noqa: E731
    assert check_output_vs_loss(_trace(lambda z: torch.softmax(z, 1), loss)).status == PASS


def test_log_softmax_into_cross_entropy_only_warns() -> None:
    assert check_output_vs_loss(_trace(lambda z: F.log_softmax(z, 1))).status == WARN


def test_log_softmax_into_nll_is_the_textbook_pairing() -> None:
    loss = lambda m, b: F.nll_loss(m(b[0]), b[1])  # noqa: E731
    assert check_output_vs_loss(_trace(lambda z: F.log_softmax(z, 1), loss)).status == PASS


@pytest.mark.parametrize("ratio, status", [(1.0, PASS), (1 + INIT_LOSS_PASS - 0.01, PASS),
                                           (1 + INIT_LOSS_PASS + 0.01, WARN), (1.9, WARN), (2.1, FAIL),
                                           (0.6, WARN), (0.45, FAIL), (math.nan, FAIL)])
def test_initial_loss_tolerance_around_ln_c(ratio: float, status: str) -> None:
    trace = Trace(loss=torch.tensor(ratio * math.log(10)))
    c = check_initial_loss(trace, LossInfo("ce", None, 10), None)
    assert c.status == status
    assert c.evidence["ln_C"] == pytest.approx(2.302585, abs=1e-6)


def test_initial_loss_of_a_regression_loss_has_no_baseline() -> None:
    c = check_initial_loss(Trace(loss=torch.tensor(50.0)), LossInfo("regression", None, None), None)
    assert c.status == PASS and "no ln C" in c.message


def test_per_class_broadcast_in_the_loss_is_not_a_shape_bug() -> None:
    weight = torch.linspace(0.5, 1.5, 5)
    loss = lambda m, b: (m(b[0]) * weight).pow(2).mean()  # noqa: E731 - [B,C] * [C] -> [B,C]
    assert check_shapes(_trace(lambda z: z, loss)).status == PASS


def test_outer_broadcast_in_a_hand_written_loss_is_caught() -> None:
    loss = lambda m, b: (m(b[0])[:, :1] - b[1].float()).pow(2).mean()  # noqa: E731 - [B,1] - [B]
    c = check_shapes(_trace(lambda z: z, loss))
    assert c.status == FAIL and c.evidence["broadcasts"][0]["output"] == [32, 32]


def test_dead_channel_of_a_conv_output() -> None:
    out = torch.rand(4, 3, 5, 5)
    out[:, 1] = 0
    assert unit_inactive("relu", out).tolist() == [False, True, False]
    assert unit_inactive("tanh", torch.full((4, 6, 8), 0.999)).all()
    assert not unit_inactive("sigmoid", torch.rand(8, 3) * 0.5 + 0.25).any()


class Affine(torch.autograd.Function):
    """y = x @ w.T with a hand-written backward for both x and w."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, wrong_w: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.wrong_w = wrong_w
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        gw = g.t() @ x
        return g @ w, (gw * 0.5 if ctx.wrong_w else gw), None  # wrong: half the weight gradient


@pytest.mark.parametrize("wrong", [False, True])
def test_gradcheck_checks_every_differentiable_input_of_a_custom_function(wrong: bool) -> None:
    w = nn.Parameter(torch.randn(5, 20))
    loss = lambda m, b: F.cross_entropy(Affine.apply(b[0], w, wrong), b[1])  # noqa: E731
    c = check_gradcheck(trace_forward(nn.Identity(), loss, tabular()[0]))
    assert c.status == (FAIL if wrong else PASS)
    assert list(c.evidence["functions"]) == [f"{__name__}.Affine"]


def test_frozen_backbone_left_out_of_the_optimizer_only_warns() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    m[0].requires_grad_(False)  # fine-tuning a head: deliberate
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    flow = {c.name: c for c in check(m, opt, _ce, tabular())}["gradient_flow"]
    assert flow.status == WARN and flow.evidence["frozen"] == ["0.weight", "0.bias"]


@pytest.mark.parametrize("labels, status, text", [
    (lambda y: y.float(), FAIL, "not integer indices"),
    (lambda y: torch.where(torch.arange(32) < 4, -100, y), PASS, "integer labels"),  # ignore_index
    (lambda y: y - 1, FAIL, "labels span [-1"),
])
def test_cross_entropy_labels(labels: Any, status: str, text: str) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 5))
    data = [(x, labels(y)) for x, y in tabular()]
    lab = check(m, torch.optim.SGD(m.parameters(), lr=0.1), _ce, data, overfit_steps=1)[0]
    assert lab.status == status and text in lab.message


def test_bce_targets_outside_0_1() -> None:
    torch.manual_seed(0)
    m = nn.Linear(20, 1)
    data = [(x, (y.float() - 1).unsqueeze(1)) for x, y in tabular()]
    loss = lambda model, b: F.binary_cross_entropy_with_logits(model(b[0]), b[1])  # noqa: E731
    lab = check(m, torch.optim.SGD(m.parameters(), lr=0.1), loss, data, overfit_steps=1)[0]
    assert lab.status == FAIL and "outside [0, 1]" in lab.message


def test_nan_inputs_fail() -> None:
    torch.manual_seed(0)
    m = nn.Linear(20, 5)
    data = tabular()
    data[1][0][3, 7] = float("nan")
    inp = check(m, torch.optim.SGD(m.parameters(), lr=0.1), _ce, data, overfit_steps=1)[1]
    assert inp.status == FAIL and inp.evidence["non_finite"] == 1


def test_split_and_slice_keep_the_batch_structure() -> None:
    batch = {"input_ids": torch.zeros(40, 8, dtype=torch.long), "labels": torch.ones(40, 8), "n": 3}
    cut = slice_batch(batch, 32)
    assert cut["input_ids"].shape == (32, 8) and cut["labels"].shape == (32, 8) and cut["n"] == 3
    assert split_batch(cut)[0] is cut["input_ids"] and split_batch(cut)[1] is cut["labels"]
    x, y = slice_batch((torch.zeros(40, 3), torch.zeros(40)), 32)
    assert x.shape == (32, 3) and y.shape == (32,)


def test_json_is_strict_even_with_nan_evidence() -> None:
    out = to_json_dict([Check("initial_loss", FAIL, "nan", {"loss": float("nan"), "t": (1, 2)}, "fix")])
    text = json.dumps(out, allow_nan=False)
    assert json.loads(text) == {"ok": False, "checks": [{"name": "initial_loss", "status": "FAIL", "message": "nan",
                                                         "evidence": {"loss": "nan", "t": [1, 2]}, "fix": "fix"}]}


def test_a_single_batch_instead_of_batches_is_bad_input() -> None:
    m = nn.Linear(20, 5)
    with pytest.raises(TypeError, match="wrap a single batch"):
        check(m, torch.optim.SGD(m.parameters(), lr=0.1), _ce, torch.zeros(4, 20))


def test_failed_overfit_points_at_the_failed_checks_first() -> None:
    from tests.preflight.zoo import PLANTED

    case = next(c for c in PLANTED if c.name == "dead_relu_init")
    model, opt, loss_fn, batches, extra = case.build()
    overfit = {c.name: c for c in check(model, opt, loss_fn, batches, **extra)}["overfit_one_batch"]
    assert overfit.status == FAIL
    assert overfit.evidence["look_first_at"] == ["gradient_flow", "dead_units"]
    assert overfit.fix.startswith("first fix the failed checks above (gradient_flow, dead_units)")


def test_a_model_that_cannot_be_copied_is_bad_input() -> None:
    import threading

    m = nn.Linear(20, 5)
    m.lock = threading.Lock()  # not deep-copyable
    with pytest.raises(ValueError, match="copy.deepcopy of the model and optimizer failed"):
        check(m, torch.optim.SGD(m.parameters(), lr=0.1), _ce, tabular())


class WithUnusedHead(nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.pooler, self.detach = nn.Linear(20, 16), nn.Linear(16, 5), nn.Linear(16, 16), detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.detach:
            return self.head(self.pooler(h).detach() + h)  # pooler called, but cut off the graph
        return self.head(h)


@pytest.mark.parametrize("detach, status", [(False, WARN), (True, FAIL)])
def test_unused_module_warns_but_a_detached_one_fails(detach: bool, status: str) -> None:
    m = WithUnusedHead(detach)
    flow = {c.name: c for c in check(m, torch.optim.Adam(m.parameters(), 1e-2), _ce, tabular(),
                                     overfit_steps=1)}["gradient_flow"]
    assert flow.status == status
    key = "no_grad" if detach else "unused_module"
    assert flow.evidence[key] == ["pooler.weight", "pooler.bias"]


def test_num_classes_against_the_output_layer() -> None:
    torch.manual_seed(0)
    m = nn.Linear(20, 5)
    lab = check(m, torch.optim.SGD(m.parameters(), lr=0.1), _ce, tabular(), num_classes=10, overfit_steps=1)[0]
    assert lab.status == FAIL and lab.evidence["model_outputs"] == 5 and "num_classes is 10" in lab.message


@pytest.mark.parametrize("wrong", [False, True])
def test_gradcheck_of_a_big_custom_function_on_element_subsets_still_catches_a_bad_backward(wrong: bool) -> None:
    w = nn.Parameter(torch.randn(64, 512) * 0.05)  # 32k weight elements: a full Jacobian is too slow
    x = torch.randn(32, 512)
    loss = lambda m, b: Affine.apply(b[0], w, wrong).pow(2).mean()  # noqa: E731
    trace = trace_forward(nn.Identity(), loss, (x, None))
    c = check_gradcheck(trace)
    assert c.status == (FAIL if wrong else PASS), c.evidence


def test_a_non_scalar_loss_is_a_shape_failure() -> None:
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731 - [B]
    c = check_shapes(_trace(lambda z: z, loss))
    assert c.status == FAIL and c.evidence["loss_shape"] == [32]


def test_labels_out_of_range_block_the_later_checks_instead_of_failing_each_with_a_traceback() -> None:
    # Regression: labels 1..5 for a 5-class loss made every later check FAIL with the same
    # IndexError traceback (8 FAILs for one bug); the later checks are SKIP, blocked by labels.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(32, 8), torch.randint(1, 6, (32,))) for _ in range(4)]
    checks = {c.name: c for c in check(model, opt, _ce, batches)}
    assert checks["labels"].status == FAIL
    assert checks["inputs"].status == PASS  # ran: it does not touch the loss
    blocked = [n for n, c in checks.items() if c.status == SKIP]
    assert blocked == ["output_vs_loss", "initial_loss", "gradient_flow", "gradients_applied", "shapes",
                       "gradcheck", "dead_units", "overfit_one_batch", "heldout"]
    for n in blocked:
        assert checks[n].evidence["blocked_by"] == "labels"
        assert "Target 5 is out of bounds" in checks[n].evidence["error"]
        assert "traceback" not in checks[n].evidence
    assert [c.name for c in checks.values() if c.status == FAIL] == ["labels"]


def test_the_same_error_from_the_model_is_one_fail_then_blocked() -> None:
    # A model whose forward raises: the first check that runs it FAILs with the traceback, every
    # later check raising the same error is blocked by that one, not a second copy of it.
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x[:, :7])  # wrong slice: mat1 and mat2 shapes cannot be multiplied

    model = Broken()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = check(model, opt, _ce, tabular())
    failed = [c for c in checks if c.status == FAIL]
    assert len(failed) == 1 and "traceback" in failed[0].evidence
    skipped = [c for c in checks if c.status == SKIP]
    assert skipped and all(c.evidence["blocked_by"] == failed[0].name for c in skipped)
    assert len(failed) + len(skipped) + sum(c.status in (PASS, WARN) for c in checks) == len(checks)
