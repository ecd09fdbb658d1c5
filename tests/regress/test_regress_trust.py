"""Issue 20 items 3 and 4: ``sentineld regress`` never turns run data into code, and never writes a
test that would import another user's code; tried with a real second local user
(``tests/reliability/test_trust_users.py``'s ``sntl_mallory``). Both fail on 49179bb: there the
recipe string went into the test's docstring verbatim, and regress wrote a test for her run that
imported her module when pytest ran it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.regress import lossfn_project as lp
from tests.reliability.test_trust_users import as_mallory, mallory, shared, train_victim  # noqa: F401

pytestmark = pytest.mark.slow


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _pytest(test: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def _give_to(user, *paths: Path) -> None:
    for top in paths:
        for p in [top, *top.rglob("*")]:
            os.lchown(p, user.pw_uid, user.pw_gid)


def test_a_recipe_string_with_triple_quotes_stays_data(shared: Path, tmp_path: Path) -> None:  # noqa: F811
    project, runs = shared / "project", shared / "runs"
    project.mkdir()
    runs.mkdir(mode=0o700)
    run_dir = train_victim(project, runs)
    marker = shared / "ran"
    meta = json.loads((run_dir / "run.json").read_text())
    meta["recipe"] = f'trainmod:make"""\nimport pathlib; pathlib.Path({str(marker)!r}).write_text("ran")\n"""'
    (run_dir / "run.json").write_text(json.dumps(meta))
    r = _cli("regress", str(run_dir), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    test = Path(r.stdout.splitlines()[0])
    # The only string literals of the test are its own text and the sidecar's name.
    tree = ast.parse(test.read_text())
    assert "pathlib.Path(" not in test.read_text()
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import) and n.names[0].name == "pathlib"]
    out = _pytest(test, project)
    assert out.returncode == 1 and not marker.exists(), out.stdout


def test_regress_refuses_another_users_run(mallory, shared: Path, tmp_path: Path) -> None:  # noqa: F811
    """Her run (recipe run) and her loss_fn run: nothing written, nothing of hers imported."""
    project, runs = shared / "project", shared / "runs"
    project.mkdir()
    runs.mkdir(mode=0o755)
    run_dir = train_victim(project, runs)
    lproject = lp.write_project(shared / "lproject")
    lrun = lp.train(lproject, runs, "hers-lossfn", CLOSE_WAIT_S="0")["run_dir"]
    _give_to(mallory, project, run_dir, lproject, lrun)
    marker = shared / "ran"
    for f in (project / "trainmod.py", lproject / "train.py"):
        as_mallory(mallory, f"printf 'import pathlib; pathlib.Path(%s).write_text(\"ran\")\\n' \"'{marker}'\" >> {f}")
    for rd in (run_dir, lrun):
        out = tmp_path / rd.name
        r = _cli("regress", str(rd), "-o", str(out), cwd=project)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "owned by" in r.stderr or "writable" in r.stderr, r.stderr
        assert not out.exists() or not list(out.iterdir())
    assert not marker.exists()
