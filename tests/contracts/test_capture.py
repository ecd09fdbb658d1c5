"""Capture round trip (real HDF5 files) and the errors a damaged capture gives."""

from __future__ import annotations

import math
import random

import h5py
import numpy as np
import pytest
import torch

from sentineld.contracts.capture import CaptureError, CaptureStep, open_capture, write_capture
from sentineld.contracts.rng import capture_rng, restore_rng
from sentineld.contracts.treecodec import TreeCodecError, decode, encode


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": None}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # Bitwise, so NaN payloads compare equal and -0.0 differs from 0.0.
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a.keys()) == list(b.keys()) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def _write(tmp_path, **kw):
    state = _state()
    batch = {"x": torch.tensor([[1.0, float("nan")]]), "y": torch.tensor([3]), "h": torch.ones(2, dtype=torch.bfloat16),
             "meta": ("a", 1, 2.5, None, True)}
    rng = capture_rng()
    args = dict(run_id="r1", rank=0, trigger="nonfinite", first_step=11, snapshot_step=10, snapshot=state,
                steps=[CaptureStep(10, batch, rng), CaptureStep(11, batch, rng)],
                records=[{"step": 10, "loss": 1.5}, {"step": 11, "loss": float("nan")}])
    args.update(kw)
    return write_capture(tmp_path / "capture-rank0-step000000011-nonfinite.h5", **args), state, batch, rng


def test_round_trip_restores_every_tensor_dtype_key_type_and_rng(tmp_path):
    path, state, batch, rng = _write(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    assert (path.stat().st_mode & 0o777) == 0o600
    with open_capture(path) as cap:
        assert (cap.run_id, cap.rank, cap.first_step, cap.snapshot_step, cap.steps) == ("r1", 0, 11, 10, [10, 11])
        snap = cap.snapshot()
        assert _equal(snap, state)
        assert isinstance(next(iter(snap["optimizer"]["state"])), int)  # int keys survive
        assert snap["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)  # tuples survive
        st = cap.step(11)
        assert _equal(st.batch, batch)
        assert torch.isnan(st.batch["x"][0, 1])
        assert math.isnan(cap.records()[1]["loss"])
        # The restored RNG draws the same numbers as the original.
        restore_rng(dict(rng))
        want = (torch.rand(3), np.random.rand(), random.random())
        random.random(); torch.rand(5)
        restore_rng(dict(st.rng))
        got = (torch.rand(3), np.random.rand(), random.random())
        assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_missing_step_lists_the_steps_held(tmp_path):
    path, *_ = _write(tmp_path)
    with open_capture(path) as cap, pytest.raises(CaptureError, match=r"step 99 is not in capture .* holds steps 10\.\.11"):
        cap.step(99)


def test_truncated_capture_is_a_clear_error(tmp_path):
    path, *_ = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(CaptureError, match="truncated or not a capture"):
        open_capture(path)


def test_not_hdf5_and_missing_file(tmp_path):
    bad = tmp_path / "capture-rank0-step000000001-nonfinite.h5"
    bad.write_text("hello")
    with pytest.raises(CaptureError, match="cannot open as HDF5"):
        open_capture(bad)
    with pytest.raises(CaptureError, match="no such capture"):
        open_capture(tmp_path / "nope.h5")


def test_unknown_schema_version_names_both_versions(tmp_path):
    path, *_ = _write(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(CaptureError, match="schema version 99 is not supported.*version 1"):
        open_capture(path)


def test_damaged_dataset_is_a_capture_error_not_a_traceback(tmp_path):
    path, *_ = _write(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["snapshot"]["tree"]
        f["snapshot"].create_dataset("tree", data="{not json")
    with open_capture(path) as cap, pytest.raises(CaptureError, match="snapshot is unreadable"):
        cap.snapshot()


def test_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(TreeCodecError, match="cannot store object at /model/weird"):
        _write(tmp_path, snapshot={"model": {"weird": object()}})
    assert list(tmp_path.iterdir()) == []


def test_treecodec_rejects_malformed_json():
    with pytest.raises(TreeCodecError):
        decode({"zz": 1}, lambda i: None)
    tensors: list = []
    enc = encode({1: (2.0, float("inf"), [None, "s"])}, tensors)
    assert decode(enc, tensors.__getitem__) == {1: (2.0, float("inf"), [None, "s"])}
