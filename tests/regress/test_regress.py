"""``sentineld regress`` on a zoo fault (the stuck-sensor zero std as a user's project in a temp
dir): the written pytest file fails on the buggy module, and passes once the module is fixed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.capture import open_capture
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
    assert r.stdout.splitlines()[:2] == [str(test), str(fixture)]

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
