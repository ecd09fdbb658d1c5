"""What write_capture writes, Capture reads back."""

from __future__ import annotations

import torch

from sentineld.contracts.capture import CaptureStep, open_capture, write_capture


def test_parameters_named_with_a_slash_read_back(tmp_path):
    """``nn.ModuleDict({"enc/in": ...})`` is legal, so parameter names may hold "/": the
    snapshot keeps them as JSON keys, never as HDF5 paths (h5py would make nested groups)."""
    model = torch.nn.ModuleDict({"enc/in": torch.nn.Linear(3, 2), "head": torch.nn.Linear(2, 2)})
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": None, "scaler": None}
    path = write_capture(tmp_path / "c.h5", run_id="r", rank=0, trigger="manual", first_step=0,
                         snapshot_step=0, snapshot=state, steps=[CaptureStep(0, None, None)], records=[])
    with open_capture(path) as cap:
        got = cap.snapshot()["model"]
    assert set(got) == set(state["model"]) and "enc/in.weight" in got
    assert all(torch.equal(got[k], state["model"][k]) for k in got)


def test_a_capture_with_the_old_grads_group_still_opens(tmp_path):
    """Captures written before the gradients were dropped from the layout hold ``/grads``:
    they open and replay as before (the group is ignored)."""
    import h5py

    state = {"model": torch.nn.Linear(3, 2).state_dict(), "optimizer": {}, "scheduler": None, "scaler": None}
    path = write_capture(tmp_path / "c.h5", run_id="r", rank=0, trigger="manual", first_step=0,
                         snapshot_step=0, snapshot=state, steps=[CaptureStep(0, None, None)], records=[])
    with h5py.File(path, "a") as f:
        g = f.create_group("grads")
        g.create_dataset("names", data='["weight"]')
        g.create_dataset("0", data=torch.ones(2, 3).numpy())
    with open_capture(path) as cap:
        assert torch.equal(cap.snapshot()["model"]["weight"], state["model"]["weight"])
        assert cap.steps == [0]

