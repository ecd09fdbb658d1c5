"""Issue 22, the smaller items: each bad input gets a message that names what was wrong. Fail on
49179bb (the runs dir named for a missing path, exit 0 for a missing --runs-dir, "has no attribute
''", "recipe" for the --data function, a UnicodeDecodeError without the file, a random port)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sentineld.agent import attach
from tests.regress import lossfn_project as lp


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    project = lp.write_project(root / "project")
    return lp.train(project, root / "runs", CLOSE_WAIT_S="0")["run_dir"]


def test_missing_paths_and_runs_dirs_are_named(tmp_path: Path) -> None:
    gone = tmp_path / "no" / "such-run"
    r = _cli("replay", str(gone))
    assert r.returncode == 2 and f"run directory {gone} does not exist" in r.stderr, r.stderr
    r = _cli("runs", "--runs-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and f"runs dir {tmp_path / 'nowhere'} does not exist" in r.stderr, r.stderr


@pytest.mark.slow
def test_recipe_without_colon_and_binary_verdict(run_dir: Path, tmp_path: Path) -> None:
    r = _cli("replay", str(run_dir), "--recipe", "train_counts")
    assert r.returncode == 2 and "must be 'module:function'" in r.stderr and "train_counts:make_recipe" in r.stderr
    cap = next(run_dir.glob("capture-*.h5"))
    r = _cli("report", str(run_dir), "--verdict", str(cap), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and str(cap) in r.stderr and "binary" in r.stderr, r.stderr


def test_preflight_data_error_says_data(tmp_path: Path) -> None:
    (tmp_path / "rec.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom sentineld.contracts.recipe import Recipe\n"
        "def make_recipe():\n    m = torch.nn.Linear(4, 3)\n"
        "    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))\n")
    r = _cli("preflight", "rec:make_recipe", "--data", "nodata:make_loader", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "data function" in r.stderr and "recipe 'nodata" not in r.stderr, r.stderr


def test_a_second_process_moves_to_the_next_port_and_says_which(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    busy = socket.socket()
    busy.bind(("127.0.0.1", base))  # the first training process on the host holds the base port
    busy.listen()
    try:
        model = torch.nn.Linear(2, 2)
        w = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_id="ports", runs_dir=tmp_path,
                   metrics_port=base, localize="off")
        try:
            assert w.metrics_port == base + 1  # inside the range a fixed scrape config lists
            assert json.loads((w.run_dir / "run.json").read_text())["extra"]["metrics_port"] == base + 1
            r = _cli("runs", "--runs-dir", str(tmp_path), "--json")
            assert [row["metrics_port"] for row in json.loads(r.stdout)] == [base + 1], r.stdout + r.stderr
        finally:
            w.close()
    finally:
        busy.close()
