"""``sentineld regress`` on a zoo fault (the stuck-sensor zero std as a user's project in a temp
dir): the written pytest file fails on the buggy module, and passes once the module is fixed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.capture import open_capture
from tests.report import planted


@pytest.fixture(scope="module")
def project_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("regress")
    project = planted.write_project(root / "project")
    return {"project": project, **planted.train(project, root / "runs")}


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _pytest(test: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


@pytest.mark.slow
def test_regression_test_fails_on_the_bug_and_passes_once_fixed(project_run: dict) -> None:
    project, run_dir = project_run["project"], project_run["run_dir"]
    out_dir = project / "tests"
    r = _cli("regress", str(run_dir), "-o", str(out_dir), cwd=project)
    assert r.returncode == 0, r.stderr
    test = out_dir / f"test_sentineld_stuck_sensor_step{planted.NAN_STEP}.py"
    fixture = out_dir / f"sentineld_stuck_sensor_step{planted.NAN_STEP}.h5"
    sidecar = out_dir / f"sentineld_stuck_sensor_step{planted.NAN_STEP}.json"
    assert r.stdout.splitlines()[:3] == [str(test), str(fixture), str(sidecar)]
    # The test users keep imports one stable name, not the replay's internals (which move).
    imports = [ln for ln in test.read_text().splitlines() if ln.startswith(("import ", "from "))]
    assert imports == ["from pathlib import Path", "from sentineld.regress import assert_steps_finite"]
    # No path of the run in the test or its sidecar: the project is "code_root", relative.
    side = json.loads(sidecar.read_text())
    assert side["code_root"] == ".." and str(project) not in test.read_text() + sidecar.read_text()

    # The fixture: a trimmed capture, snapshot 5 and steps 5..7 only.
    with open_capture(fixture) as cap:
        assert (cap.snapshot_step, cap.first_step, cap.steps) == (5, 7, [5, 6, 7])
        assert [rec["step"] for rec in cap.records()] == [5, 6, 7]
    assert fixture.stat().st_size < Path(project_run["captures"][0]).stat().st_size

    bad = _pytest(test, project)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"step {planted.NAN_STEP}: the loss is nan" in bad.stdout

    planted.fix_bug(project)
    good = _pytest(test, project)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "1 passed" in good.stdout


def test_an_earlier_step_passes_and_bad_steps_are_refused(project_run: dict, tmp_path: Path) -> None:
    project = tmp_path / "p"
    shutil.copytree(project_run["project"], project)  # the buggy module, whatever the test above did
    (project / "stuck_sensor.py").write_text(planted.MODULE)
    r = _cli("regress", str(project_run["run_dir"]), "--step", "6", "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    ok = _pytest(tmp_path / "out" / "test_sentineld_stuck_sensor_step6.py", project)
    assert ok.returncode == 0, ok.stdout  # steps 5..6 were finite in the run too
    r = _cli("regress", str(project_run["run_dir"]), "--step", "3", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "step 3 is in no capture" in r.stderr


def test_a_run_without_recipe_is_refused(project_run: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "copy"
    shutil.copytree(project_run["run_dir"], run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    meta["recipe"] = None
    (run_dir / "run.json").write_text(json.dumps(meta))
    r = _cli("regress", str(run_dir), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "recorded no recipe" in r.stderr
    assert not (tmp_path / "out").exists()


ADAM_EPS = '''"""The zoo's adam_eps_fp16 fault as a user's module: a float16 model, Adam(eps=1e-8)."""
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.recipe import Recipe

EPS = 1e-8  # rounds to 0 in float16: 0/0 for embedding rows no batch has touched yet


class BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(64, 16, mode="mean")
        self.head = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def _ce(model, batch):
    tokens, y = batch
    return F.cross_entropy(model(tokens).float(), y)


def make_recipe(seed=0):
    torch.manual_seed(seed)
    model = BagNet().half()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3, eps=EPS), loss_fn=_ce)


def batch(step):
    g = torch.Generator().manual_seed(11000 + step)
    return torch.randint(0, 48, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)
'''


@pytest.mark.slow
def test_a_fix_of_optimizer_settings_needs_hyperparameters_from_the_recipe(tmp_path: Path) -> None:
    project = planted.write_project(tmp_path / "project", ADAM_EPS, "bag")
    run = planted.train(project, tmp_path / "runs", "adam-eps", steps=4)
    r = _cli("regress", str(run["run_dir"]), "-o", str(project), cwd=project)
    assert r.returncode == 0, r.stderr
    test = Path(r.stdout.splitlines()[0])
    bad = _pytest(test, project)
    assert bad.returncode == 1 and "step 0: parameters non-finite after the optimizer step: ['emb.weight'" in bad.stdout

    bag = project / "bag.py"
    bag.write_text(bag.read_text().replace("EPS = 1e-8", "EPS = 1e-4"))
    # The captured optimizer state still says eps=1e-8: with the default, the fix is not seen...
    assert _pytest(test, project).returncode == 1
    # ...with the recipe's settings it is.
    test.write_text(test.read_text().replace('HYPERPARAMETERS = "capture"', 'HYPERPARAMETERS = "recipe"'))
    good = _pytest(test, project)
    assert good.returncode == 0, good.stdout + good.stderr


NAN_BATCH = '''"""A healthy MLP fed one bad batch: a sensor reading of NaN at step 3."""
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.recipe import Recipe


def make_recipe(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(8, 6, generator=g)
    if step == 3:
        x[2, 4] = float("nan")
    return x, torch.randint(0, 3, (8,), generator=g)
'''


@pytest.mark.slow
def test_a_data_fault_is_written_with_a_warning_that_the_test_cannot_pass(tmp_path: Path) -> None:
    # Regression (a new user on an HF run with an inf label): the fixture carries the bad batch,
    # so the written test fails for ever, and regress said nothing about it.
    project = planted.write_project(tmp_path / "project", NAN_BATCH, "sensor")
    run = planted.train(project, tmp_path / "runs", "nan-batch", steps=6)
    r = _cli("regress", str(run["run_dir"]), "-o", str(project), cwd=project)
    assert r.returncode == 0, r.stderr
    assert "warning: the batch of step 3 itself holds NaN/Inf (a data fault)" in r.stderr
    assert "Guard the data instead" in r.stderr
    # an earlier step of the same run, whose batch is clean, gets no such warning
    healthy = _cli("regress", str(tmp_path / "runs" / "nan-batch"), "--step", "2", "-o", str(tmp_path / "o2"),
                   cwd=project)
    assert healthy.returncode == 0 and "warning" not in healthy.stderr, healthy.stderr
