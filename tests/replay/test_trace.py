"""Birth rules of the tracer, as a truth table over small functions."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from sentineld.replay.trace import Tracer, tensor_stats

INF = float("inf")


class Wrap(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# (name, function of x = [0., 1., 2.], expected first birth (op, kind) or None)
TABLE = [
    ("log of zero", lambda x: torch.log(x), ("aten.log", "inf")),
    ("fill with -inf scalar", lambda x: x.masked_fill(x > 0, -INF), None),
    ("softmax of an all -inf row", lambda x: torch.softmax(torch.full_like(x, -INF), 0), ("aten._softmax", "nan")),
    ("0 / 0", lambda x: x / x, ("aten.div", "nan")),
    ("finite arithmetic", lambda x: (x * 2 + 1).exp(), None),
    ("overflow of exp", lambda x: (x * 100).exp(), ("aten.exp", "inf")),
    ("inf - inf", lambda x: torch.log(x) - torch.log(x), ("aten.log", "inf")),
    ("float16 cast overflow", lambda x: (x * 1e5).half(), ("aten._to_copy", "inf")),
    ("in-place 0/0", lambda x: x.clone().div_(x), ("aten.div_", "nan")),
    ("where hides log(0)", lambda x: torch.where(x > 0, torch.log(x), 0.0), ("aten.log", "inf")),
]


@pytest.mark.parametrize("name,fn,want", TABLE, ids=[t[0] for t in TABLE])
def test_birth_truth_table(name: str, fn: Callable[[torch.Tensor], torch.Tensor], want: tuple[str, str] | None) -> None:
    model = Wrap(fn)
    with Tracer(model) as tr:
        model(torch.tensor([0.0, 1.0, 2.0]))
    got = (tr.births[0].op, tr.births[0].kind) if tr.births else None
    assert got == want
    if want is not None:
        assert tr.births[0].module == ""  # the root module ran it


def test_masked_birth_does_not_escape_its_module() -> None:
    model = Wrap(lambda x: torch.where(x > 0, torch.log(x), 0.0))
    with Tracer(model) as tr:
        model(torch.tensor([0.0, 1.0]))
    assert tr.births and not (tr.calls[0].out_nan or tr.calls[0].out_inf)


def test_backward_birth_is_traced_to_its_module() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2, bias=False)
            self.norm = Wrap(lambda h: h / (torch.sqrt((h * h).sum(-1, keepdim=True)) + 1e-6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x)).sum()

    net = Net()
    with Tracer(net) as tr:
        loss = net(torch.zeros(1, 2))
        tr.set_phase("backward")
        loss.backward()
    b = tr.births[0]
    assert (b.phase, b.module, b.autograd_node, b.kind) == ("backward", "norm", "SqrtBackward0", "nan")
    # the forward op that made the node, recorded while the graph was built
    assert (b.op, b.forward_op, b.custom_function, b.where_branch) == ("aten.div", "aten.sqrt", None, False)


def test_tensor_stats() -> None:
    s = tensor_stats(torch.tensor([0.0, -2.0, float("nan"), INF], dtype=torch.float16))
    assert s == {"dtype": "float16", "shape": [4], "numel": 4, "nan": 1, "posinf": 1, "neginf": 0,
                 "nonfinite": 2, "zeros": 1, "min": -2.0, "max": 0.0, "finite_max_abs": 2.0}
