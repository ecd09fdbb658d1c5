"""Bad input that used to break ``sentineld preflight``: each test is the input that broke it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sentineld.contracts.recipe import Recipe
from sentineld.preflight.runner import check_recipe

SENTINELD = Path(sys.executable).with_name("sentineld")

MODULE = textwrap.dedent('''
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    from sentineld.recipe import Recipe

    def _m():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def ok():
        m = _m()
        return Recipe(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    def exits():
        m = _m()
        def loss(m, b):
            sys.exit(3)
        return Recipe(m, torch.optim.SGD(m.parameters(), lr=0.1), loss)

    def _xy():
        return torch.randn(16, 4), torch.randint(0, 3, (16,))

    def data():
        return [_xy()]

    def breaks_midway():
        def gen():
            yield _xy()
            raise RuntimeError("loader broke")
        return gen()

    def breaks_at_once():
        def gen():
            raise OSError("disk gone")
            yield
        return gen()
''')


def _run(tmp_path: Path, recipe: str, data: str) -> subprocess.CompletedProcess[str]:
    tmp_path.chmod(0o700)
    (tmp_path / "advpf.py").write_text(MODULE)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(SENTINELD), "preflight", f"advpf:{recipe}", "--data", f"advpf:{data}",
                           "--steps", "5", "--json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("data", "error"), [("breaks_midway", "RuntimeError: loader broke"),
                                             ("breaks_at_once", "OSError: disk gone")])
def test_data_iterator_that_raises_is_bad_input_not_a_traceback(tmp_path: Path, data: str, error: str) -> None:
    r = _run(tmp_path, "ok", data)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert error in r.stderr and "data pipeline" in r.stderr


def test_loss_fn_calling_sys_exit_is_bad_input_not_its_exit_code(tmp_path: Path) -> None:
    r = _run(tmp_path, "exits", "data")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "sys.exit(3)" in r.stderr and "Traceback" not in r.stderr


class _CopyIsSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def __deepcopy__(self, memo: dict) -> "_CopyIsSelf":
        return self


def test_deepcopy_returning_self_is_refused_and_the_model_keeps_no_grad() -> None:
    torch.manual_seed(0)
    model = _CopyIsSelf()
    recipe = Recipe(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    with pytest.raises(ValueError, match="sharing the model's parameters"):
        check_recipe(recipe, [(torch.randn(8, 4), torch.randint(0, 3, (8,)))], overfit_steps=3)
    assert all(p.grad is None for p in model.parameters())  # before the fix: backward ran on the user's model
