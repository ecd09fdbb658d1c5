"""``sentineld preflight`` end to end: the real console script on recipe/data modules in a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentineld.cli import cli

SENTINELD = Path(sys.executable).with_name("sentineld")

MODULE = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    from sentineld.recipe import Recipe

    def _ce(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def make_recipe():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
        print("building the recipe")  # the user's prints must not reach stdout
        return Recipe(m, torch.optim.Adam(m.parameters(), lr=1e-2), _ce)

    def make_buggy():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5), nn.Softmax(dim=1))
        return Recipe(m, torch.optim.Adam(m.parameters(), lr=1e-2), _ce, zero_grad=False)

    def not_a_recipe():
        return 42

    def data():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(20, 5, generator=g)
        x = torch.randn(128, 20, generator=g)
        ds = torch.utils.data.TensorDataset(x, (x @ w).argmax(1))
        return torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True)

    def shifted():  # labels 1..5 for a 5-class loss: every loss raises
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 20, generator=g)
        ds = torch.utils.data.TensorDataset(x, torch.randint(1, 6, (64,), generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=32)

    def no_data():
        return None

    def empty():
        return []
''')


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    tmp_path.chmod(0o700)
    (tmp_path / "pftrain.py").write_text(MODULE)
    return tmp_path


def _run(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([str(SENTINELD), "preflight", *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)


def test_healthy_recipe_exits_0_with_a_table(workdir: Path) -> None:
    r = _run(workdir, "pftrain:make_recipe", "--data", "pftrain:data")
    assert r.returncode == 0, r.stderr
    assert "building the recipe" in r.stderr and "building the recipe" not in r.stdout
    for name in ("labels", "output_vs_loss", "gradient_flow", "overfit_one_batch"):
        assert name in r.stdout
    assert "FAIL" not in r.stdout and "preflight ok: 11 pass" in r.stdout
    assert "[32, 64]" in r.stdout  # the per-module shape table


def test_buggy_recipe_exits_1_and_json_names_the_failures(workdir: Path) -> None:
    r = _run(workdir, "pftrain:make_buggy", "--data", "pftrain:data", "--json", "--lr-range",
             "--lr-plot", "plots/lr.svg", "--num-classes", "5")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is False
    failed = {c["name"] for c in out["checks"] if c["status"] == "FAIL"}
    assert {"output_vs_loss", "gradients_applied"} <= failed
    assert "softmax" in next(c for c in out["checks"] if c["name"] == "output_vs_loss")["evidence"]["ops"]
    assert [c["name"] for c in out["checks"]][-1] == "lr_range"
    assert out["checks"][0]["evidence"]["num_classes"] == 5
    assert (workdir / "plots" / "lr.svg").read_text().count("<svg") == 1


@pytest.mark.parametrize("args, message", [
    (["pftrain", "--data", "pftrain:data"], "RECIPE must be MODULE:FUNCTION"),
    (["pftrain:make_recipe", "--data", "pftrain"], "--data must be MODULE:FUNCTION"),
    (["pftrain:missing", "--data", "pftrain:data"], "has no attribute 'missing'"),
    # it said "run preflight in the directory holding the module", run from that very directory
    (["pftrain:missing", "--data", "pftrain:data"], "define missing() in pftrain.py"),
    (["nosuchmodule:make", "--data", "pftrain:data"], "run preflight in the directory holding the module"),
    (["nosuchmodule:make", "--data", "pftrain:data"], "No module named 'nosuchmodule'"),
    (["pftrain:not_a_recipe", "--data", "pftrain:data"], "returned int, not a sentineld.recipe.Recipe"),
    (["pftrain:make_recipe", "--data", "pftrain:no_data"], "must be an iterable of batches, got NoneType"),
    (["pftrain:make_recipe", "--data", "pftrain:empty"], "yielded no batch"),
    (["pftrain:make_recipe", "--data", "pftrain:data", "--lr-plot", "x.pdf"], "must end in .png or .svg"),
])
def test_bad_input_exits_2_with_a_message(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                          args: list[str], message: str) -> None:
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("pftrain", None)
    r = CliRunner().invoke(cli, ["preflight", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_module_writable_by_others_is_refused(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (workdir / "pftrain.py").chmod(0o666)
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("pftrain", None)
    r = CliRunner().invoke(cli, ["preflight", "pftrain:make_recipe", "--data", "pftrain:data"])
    assert r.exit_code == 2
    assert "writable by group or others" in r.output and "--trust" in r.output


def test_piped_table_is_not_cut_and_blocked_checks_name_their_blocker_once(workdir: Path) -> None:
    # Regression (a new user): piped, the table wrapped at 80 columns; the overfit check, blocked
    # by the labels, said "first fix the failed checks above (labels); fix the labels check first".
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([str(SENTINELD), "preflight", "pftrain:make_recipe", "--data", "pftrain:shifted"],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    rows = [line for line in r.stdout.splitlines() if "overfit_one_batch" in line]
    assert len(rows) == 1 and "SKIP" in rows[0], r.stdout
    assert "fix the labels check first, then rerun preflight" in rows[0]  # whole, on its row
    assert "first fix the failed checks above" not in r.stdout
    assert "1 fail, 8 not run (blocked by a failed check)" in r.stdout
    # ...and not one line per row either: piped, the unbounded width made a ~700-column table
    # (a new user); the text columns wrap at words.
    assert max(len(line) for line in r.stdout.splitlines()) <= 220, max(r.stdout.splitlines(), key=len)
