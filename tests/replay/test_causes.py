"""Backward verdicts name the forward op and a cause class that follows the evidence, on variants
of the seen-wrong faults other than the zoo's (issue 10, "Verdict wording")."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.verdict import CAUSE_CLASSES, OUTSIDE_MODEL, Finding, Replayed, make_report, report_problems
from sentineld.replay.causes import Cause, Facts, likely_cause
from sentineld.replay.localize import localize
from sentineld.replay.nodeops import op_from_node_name

INF = float("inf")


class Cube(torch.autograd.Function):
    """x ** 3 with a hand-written backward that overflows: 3 * x ** 2 computed as exp(2 log|x|) * 3."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(-30, 30) ** 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * torch.exp(2 * torch.log(x.abs() + 1) * 40)


class Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Net(nn.Module):
    """(B, 4) -> lin -> f -> (B, 4); ``f`` is where the fault lives."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.f = Fn(fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.lin(x))


def _verdict(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.sum()) -> Finding:
    torch.manual_seed(0)
    model = Net(fn)
    with torch.no_grad():  # lin is the identity: the batch reaches f as it is
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    rec = Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 loss_fn=lambda m, b: loss(m(b)))
    r = localize(rec, 0, x, None, None)
    verdict = asdict(make_report(Replayed(r, requested_step=0, reproduced=True), "r1"))
    assert report_problems(verdict, "r1") == [], verdict
    return r


ROW0 = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])

# (name, f, batch, (op, primitive, node, cause class))
BACKWARD = [
    ("acos at exactly 1", lambda h: torch.acos(h.clamp(-1, 1)), torch.tensor([[1.0, 0.5, 0.2, 0.1]]),
     ("aten.acos", "aten.rsqrt", "AcosBackward0", "grad_at_singularity")),
    ("pow 0.25 of a square at 0", lambda h: (h * h) ** 0.25, ROW0,
     ("aten.pow", "aten.pow", "PowBackward0", "grad_at_singularity")),
    ("learnable exponent at base 0", lambda h: (h * h) ** torch.full((4,), 0.3, requires_grad=True), ROW0,
     ("aten.pow", "aten.pow", "PowBackward1", "grad_at_singularity")),
    ("masked_fill after sqrt", lambda h: torch.sqrt(h * h).masked_fill(h == 0, 0.0), ROW0,
     ("aten.sqrt", "aten.div", "SqrtBackward0", "where_masked_branch")),
    ("where over 2 * sqrt", lambda h: torch.where(h != 0, 2 * torch.sqrt(h * h), 0.0), ROW0,
     ("aten.sqrt", "aten.div", "SqrtBackward0", "where_masked_branch")),
    ("custom Function overflowing in its backward", lambda h: Cube.apply(h), ROW0,
     ("Cube", "aten.exp", "CubeBackward", "custom_backward")),
]


@pytest.mark.parametrize("name,fn,x,want", BACKWARD, ids=[b[0] for b in BACKWARD])
def test_backward_verdict_names_the_forward_op(name: str, fn: Callable[[torch.Tensor], torch.Tensor],
                                               x: torch.Tensor, want: tuple[str, str, str, str]) -> None:
    r = _verdict(fn, x)
    got = (r.op, r.evidence.get("primitive"), r.autograd_node, r.cause_class)
    assert (r.phase, r.module, r.where) == ("backward", "f", "module 'f' (Fn)"), r.to_json()
    assert got == want, r.to_json()
    if r.cause_class != "custom_backward":
        assert "clip" not in r.fix
    if r.cause_class == "where_masked_branch":
        assert "mask the input before sqrt" in r.fix and r.evidence["where_branch"] is True


def test_where_over_a_forward_nan_is_the_masked_branch() -> None:
    # sqrt of a negative number is NaN in forward, dropped by where; its gradient is NaN with no
    # birth in backward (0 / (2 * NaN)): the masked forward birth is named.
    r = _verdict(lambda h: torch.where(h > 0, torch.sqrt(h), 0.0), torch.tensor([[-1.0, 1.0, 2.0, 3.0]]))
    assert (r.phase, r.module, r.op, r.cause_class) == ("backward", "f", "aten.sqrt", "where_masked_branch")
    assert r.evidence["masked_forward_birth"]["op"] == "aten.sqrt"


def test_a_plain_sqrt_at_zero_is_not_the_where_branch() -> None:
    r = _verdict(lambda h: torch.sqrt((h * h).sum(-1)), torch.zeros(1, 4))
    assert (r.op, r.autograd_node, r.cause_class) == ("aten.sqrt", "SqrtBackward0", "grad_at_singularity")
    assert r.evidence["where_branch"] is False and "sqrt(x + eps)" in r.fix


def test_backward_outside_the_model_has_module_null_and_says_where() -> None:
    r = _verdict(lambda h: h, ROW0, loss=lambda out: torch.sqrt(out * out).sum())
    assert (r.phase, r.module, r.module_type, r.where, r.op) == \
        ("backward", None, None, OUTSIDE_MODEL, "aten.sqrt")


def test_a_loss_module_outside_the_model_keeps_its_type() -> None:
    target = torch.zeros(2, dtype=torch.long)
    r = _verdict(lambda h: h, torch.full((2, 4), 0.0).log(), loss=lambda out: nn.CrossEntropyLoss()(out, target))
    assert r.phase == "data"  # a -inf batch is the data's fault, whatever the loss
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    r = _verdict(lambda h: h, logits, loss=lambda out: nn.NLLLoss(ignore_index=0)(F.log_softmax(out, -1), target[:1]))
    assert (r.phase, r.module, r.module_type, r.where) == \
        ("forward", None, "NLLLoss", "loss module NLLLoss, outside the model")
    assert r.cause_class == "mean_empty"


@pytest.mark.parametrize("name,want", [
    ("AcosBackward0", "aten.acos"), ("PowBackward1", "aten.pow"), ("SoftmaxBackward0", "aten._softmax"),
    ("NllLossBackward0", "aten.nll_loss_forward"), ("LinalgVectorNormBackward0", "aten.linalg_vector_norm"),
    ("NativeLayerNormBackward0", "aten.native_layer_norm"), ("AddmmBackward0", "aten.addmm"),
    ("torch::autograd::AccumulateGrad", None), ("NoSuchOpBackward0", None),
])
def test_op_from_node_name(name: str, want: str | None) -> None:
    assert op_from_node_name(name) == want


def test_every_cause_has_a_known_class() -> None:
    with pytest.raises(ValueError, match="not in CAUSE_CLASSES"):
        Cause("clip_gradients", "c", "f", "")
    seen = {likely_cause(Facts(phase)).cls for phase in ("data", "none", "forward", "backward", "optimizer")}
    assert seen <= set(CAUSE_CLASSES)
    assert likely_cause(Facts("backward", "aten.mm", "inf", forward_op="aten.mm")).cls == "grad_explosion"
    assert likely_cause(Facts("backward", "aten.exp", "inf", forward_op="aten.exp")).cls == "unknown"
