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
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert "--state-dir" in out.stdout and "running daemon" in out.stdout
