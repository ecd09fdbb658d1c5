"""A runs dir given as "~/runs" (attach's runs_dir= or SENTINELD_RUNS_DIR) is the user's home
runs dir, as the daemon's --runs-dir reads it: found as a README user wrote `runs_dir="~/runs"`
and got a literal `./~/runs` that no daemon watched."""

from pathlib import Path

import pytest
import torch

from sentineld.agent import attach
from sentineld.contracts.rundir import default_runs_dir


def _one_step(tmp_path: Path, **kw: object) -> Path:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    watch = attach(model, opt, run_id="tilde", metrics_port=0, localize="off", **kw)
    x = torch.randn(8, 4)
    opt.zero_grad()
    loss = model(x).sum()
    loss.backward()
    opt.step()
    watch.step(loss, batch=(x,))
    watch.close()
    return tmp_path


def test_attach_expands_tilde_in_runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    _one_step(tmp_path, runs_dir="~/runs")
    assert (home / "runs" / "tilde" / "stream-rank0.jsonl").is_file()
    assert not (cwd / "~").exists()


def test_env_runs_dir_expands_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SENTINELD_RUNS_DIR", "~/runs")
    assert default_runs_dir() == tmp_path / "runs"
