"""Bad input never ends in a traceback: each case is a clear message and a documented exit code
(``sentineld replay``: 0 reproduced, 1 not reproduced, 2 bad input), and code named by a run is
imported only when it is safely ours."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import h5py
import pytest
from click.testing import CliRunner

from sentineld.cli import cli
from sentineld.contracts.rundir import list_captures

from .conftest import edit_run_json


def replay(*args: str) -> Any:
    result = CliRunner().invoke(cli, ["replay", *args])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def capture_of(run: Path) -> Path:
    return list_captures(run)[0][3]


def test_reproduced_json_exit_0(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    r = replay(str(run), "--step", "5", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert (report["phase"], report["reproduced"], report["step"]) == ("none", True, 5)


def test_not_reproduced_exit_1(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    cap = capture_of(run)
    with h5py.File(cap, "r+") as f:
        records = json.loads(f["records"][()])
        records[0]["loss"] += 1e-3  # the recorded loss of the snapshot step no longer matches
        del f["records"]
        f.create_dataset("records", data=json.dumps(records))
    r = replay(str(run), "--step", "5", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["max_loss_deviation"] == pytest.approx(1e-3, rel=1e-3)


def test_truncated_capture_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    cap = capture_of(run)
    data = cap.read_bytes()
    cap.write_bytes(data[: len(data) // 2])
    r = replay(str(run))
    assert r.exit_code == 2 and cap.name in r.stderr and "truncated" in r.stderr


def test_not_a_capture_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    capture_of(run).write_bytes(os.urandom(4096))
    r = replay(str(run))
    assert r.exit_code == 2 and "cannot open as HDF5" in r.stderr


def test_damaged_snapshot_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    with h5py.File(capture_of(run), "r+") as f:
        del f["snapshot/0"]
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and "snapshot is unreadable" in r.stderr


def test_unknown_schema_version_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    with h5py.File(capture_of(run), "r+") as f:
        f.attrs["schema_version"] = 99
    r = replay(str(run))
    assert r.exit_code == 2 and "schema version 99" in r.stderr


def test_step_not_captured_lists_the_steps_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    r = replay(str(run), "--step", "999")
    assert r.exit_code == 2 and "step 999" in r.stderr and "4..5" in r.stderr
    r = replay(str(run), "--step", "1", "--capture", str(capture_of(run)))
    assert r.exit_code == 2 and "holds steps 4..5" in r.stderr


def test_model_that_does_not_match_the_capture_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    edit_run_json(run, recipe_args={"hidden": 16})
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and "cannot be rebuilt" in r.stderr and "size mismatch" in r.stderr


def test_recipe_that_raises_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    edit_run_json(run, recipe_args={"hidden": -1})
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and "raised while building the model" in r.stderr


def test_missing_recipe_function_exit_2(mini_run: tuple[Path, Path]) -> None:
    run, src = mini_run
    edit_run_json(run, recipe=f"{src.stem}:nope")
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and "cannot import recipe" in r.stderr


def test_group_writable_recipe_is_not_imported(mini_run: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    run, src = mini_run
    src.chmod(src.stat().st_mode | stat.S_IWGRP)
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and "writable by group or others" in r.stderr and "--trust" in r.stderr
    with caplog.at_level(logging.WARNING, logger="sentineld.replay"):
        r = replay(str(run), "--step", "5", "--trust")
    assert r.exit_code == 0, r.output
    assert "without ownership checks" in caplog.text


def test_group_writable_run_json_or_folder_is_refused(mini_run: tuple[Path, Path]) -> None:
    run, src = mini_run
    (run / "run.json").chmod(0o660)
    assert replay(str(run), "--step", "5").exit_code == 2
    (run / "run.json").chmod(0o600)
    src.parent.chmod(0o770)
    r = replay(str(run), "--step", "5")
    assert r.exit_code == 2 and str(src.parent) in r.stderr


def test_unknown_run_exit_2(tmp_path: Path) -> None:
    r = replay("no-such-run", "--runs-dir", str(tmp_path))
    assert r.exit_code == 2 and "no run 'no-such-run'" in r.stderr


def test_a_sequential_without_recipe_is_rebuilt_from_its_recorded_structure(tmp_path: Path) -> None:
    """Regression (adversarial tester): a plain nn.Sequential watched without loss_fn or recipe;
    the forward-only replay rebuilt ``Sequential()`` (no layers) and said only "Sequential() does not
    match the captured state". It then said a recipe was needed; now the agent records the model's
    structure (issue 22), so the forward-only replay rebuilds the Sequential with its layers and
    names the batch's NaN: phase data, sample 0."""
    import torch
    from torch import nn

    from sentineld.agent import attach

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    with attach(model, opt, run_id="seq", runs_dir=runs, metrics_port=0,
                capture_on_sigterm=False) as watch:
        for step in range(8):
            x = torch.randn(4, 4)
            if step == 5:
                x[0, 0] = float("inf") * 0  # nan in the batch
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            watch.step(loss, batch=x)
    assert watch.captures, "no capture to replay"
    r = CliRunner().invoke(cli, ["replay", str(watch.run_dir), "--json"])
    assert r.exit_code == 0, r.output
    verdict = json.loads(r.output)
    assert (verdict["phase"], verdict["step"], verdict["cause_class"]) == ("data", 5, "data_nonfinite")
    assert verdict["evidence"]["samples"] == [0] and verdict["evidence"]["mode"] == "forward_only"
