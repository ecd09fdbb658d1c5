"""`sentineld runs` lists the runs dir of the daemon that is running (a new user passed
`--state-dir` to it as to `status` and `stop`; on d9bb298 it listed the default runs dir)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.reliability.checks import write_run


def test_runs_lists_the_running_daemons_runs_dir(daemon_factory, tmp_path):
    runs = tmp_path / "watched"
    d = daemon_factory(runs_dir=runs, state_dir=tmp_path / "state", extra=["--no-replay"])
    write_run(runs, "listed-run", 10)
    env_runs = tmp_path / "elsewhere"  # what the config alone would point at
    env_runs.mkdir()
    import os

    env = {**os.environ, "SENTINELD_RUNS_DIR": str(env_runs)}
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--state-dir", str(d.state_dir), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert [r["run_id"] for r in json.loads(out.stdout)] == ["listed-run"]
    # no flag: the configured state dir ($SENTINELD_STATE_DIR here) holds the running daemon's status
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--json"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**env, "SENTINELD_STATE_DIR": str(d.state_dir)})
    assert out.returncode == 0, out.stderr
    assert [r["run_id"] for r in json.loads(out.stdout)] == ["listed-run"]
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**env, "SENTINELD_STATE_DIR": str(d.state_dir)})
    assert f"runs in {runs}" in out.stdout.splitlines(), out.stdout
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert "--state-dir" in out.stdout and "running daemon" in out.stdout


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, **(env or {})})


def test_runs_output_to_a_pipe_is_not_wrapped_at_80_columns(tmp_path):
    """Off a terminal rich wrapped at 80 columns (issue 10): the runs dir in the title was cut and
    a long run id broke across lines. Piped here (stdout is not a terminal)."""
    runs = tmp_path / ("a-long-runs-directory-name-" * 3) / "runs"
    run_id = "experiment-with-a-rather-long-name-2026-12-01T14-15-27-seed-1234567"
    write_run(runs, run_id, 5)
    out = _cli("runs", "--runs-dir", str(runs), env={"COLUMNS": "", "TERM": "dumb"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"runs in {runs}" in lines
    assert any(run_id in ln for ln in lines), out.stdout


def test_runs_dir_has_help_under_replay_runs_and_recover():
    for cmd in ("replay", "runs", "recover"):
        out = _cli(cmd, "--help")
        assert out.returncode == 0, out.stderr
        block = out.stdout.split("--runs-dir", 1)[1].split("\n  -", 1)[0]
        assert "SENTINELD_RUNS_DIR" in block, (cmd, out.stdout)


def test_demo_without_scikit_learn_says_what_to_install():
    """No traceback (issue 10): scikit-learn made unimportable the way a missing package is."""
    code = ("import sys; sys.modules['sklearn'] = None\n"  # `import sklearn` raises ImportError
            "from sentineld.cli import main; sys.argv = ['sentineld', 'demo']; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "scikit-learn" in out.stderr and "pip install 'sentineld[demo]'" in out.stderr
