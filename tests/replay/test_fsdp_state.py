"""Sharded snapshots: placeholders in, values back (contracts/dcpstate.py), and the replay's
memory check (replay/fsdp.py) naming what to do."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sentineld.contracts.capture import CaptureStep, open_capture, write_capture
from sentineld.contracts.dcpstate import (
    PLACEHOLDER,
    checkpoint_bytes,
    dcp_dir_name,
    fill_sharded,
    load_consolidated,
    parse_dir_name,
    placeholders,
    split_sharded,
)
from sentineld.replay.engine import ReplayError
from sentineld.replay.fsdp import consolidated_snapshot


class Shard:
    """Stands for a DTensor leaf in the pure split/fill round trip."""


def test_split_and_fill_round_trip() -> None:
    a, b = Shard(), Shard()
    state = {"model": {"w": a, "n": 3},
             "optimizer": {"state": {0: {"exp_avg": b, "step": 1.0}}, "param_groups": [{"lr": 0.1}]}}
    plain, out = split_sharded(state, lambda x: isinstance(x, Shard))
    assert out == {"model/w": a, "optimizer/state/0/exp_avg": b}
    assert plain["model"]["w"] == {PLACEHOLDER: "model/w"} and plain["optimizer"]["state"][0]["step"] == 1.0
    assert sorted(placeholders(plain)) == sorted(out)
    assert fill_sharded(plain, {"model/w": 1, "optimizer/state/0/exp_avg": 2})["optimizer"]["state"][0]["exp_avg"] == 2
    with pytest.raises(KeyError, match="model/w"):
        fill_sharded(plain, {})
    assert parse_dir_name(dcp_dir_name(7, "nonfinite", 4)) == (7, "nonfinite", 4)


def _sharded_capture(run: Path) -> Path:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    name = dcp_dir_name(2, "nonfinite", 0)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save({"model/w": w}, checkpoint_id=str(run / name), no_dist=True)
    path = run / "capture-rank0-step000000002-nonfinite.h5"
    write_capture(path, run_id="r", rank=0, trigger="nonfinite", first_step=2, snapshot_step=0,
                  snapshot={"model": {"w": {PLACEHOLDER: "model/w"}}, "optimizer": {}, "scheduler": None,
                            "scaler": None},
                  steps=[CaptureStep(s, (torch.zeros(1),), None) for s in range(3)], records=[],
                  sharded_state=name)
    return path


def test_consolidated_snapshot_and_its_memory_check(tmp_path: Path) -> None:
    path = _sharded_capture(tmp_path)
    with open_capture(path) as cap:
        assert cap.sharded_state == dcp_dir_name(2, "nonfinite", 0)
        assert checkpoint_bytes(tmp_path / cap.sharded_state) == 48
        assert torch.equal(load_consolidated(tmp_path / cap.sharded_state)["model/w"],
                           torch.arange(12, dtype=torch.float32).reshape(3, 4))
        whole, ev = consolidated_snapshot(cap, cap.snapshot())
        assert torch.equal(whole["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
        assert ev["state"] == "consolidated" and ev["consolidated_bytes"] == 48
        # One rank wrote it (one __0_0.distcp): the message names the size to pass.
        with pytest.raises(ReplayError, match=r"sentineld replay .* --world-size 1$"):
            consolidated_snapshot(cap, cap.snapshot(), available=100)


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = _sharded_capture(tmp_path)
    shutil.rmtree(tmp_path / dcp_dir_name(2, "nonfinite", 0))
    with open_capture(path) as cap, pytest.raises(ReplayError, match="copy the whole"):
        consolidated_snapshot(cap, cap.snapshot())
