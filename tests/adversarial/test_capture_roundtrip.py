"""What write_capture writes, Capture reads back."""

from __future__ import annotations

import torch

from sentineld.contracts.capture import CaptureStep, open_capture, write_capture


def test_gradients_of_parameters_named_with_a_slash_read_back(tmp_path):
    """``nn.ModuleDict({"enc/in": ...})`` is legal, so parameter names may hold "/". The agent
    stores evidence gradients under ``/grads/<param name>``; Capture.grads() must return them by
    the same names.

    Today h5py turns "enc/in.weight" into nested groups, and grads() on the agent's own capture
    raises CaptureError "grads is unreadable ... the capture is damaged".
    """
    g = {"enc/in.weight": torch.ones(2, 3), "head.bias": torch.zeros(2)}
    path = write_capture(tmp_path / "c.h5", run_id="r", rank=0, trigger="manual", first_step=0,
                         snapshot_step=0, snapshot={"model": {}, "optimizer": {}, "scheduler": None,
                                                    "scaler": None},
                         steps=[CaptureStep(0, None, None)], records=[], grads=g)
    with open_capture(path) as cap:
        got = cap.grads()
    assert set(got) == set(g)
    assert all(torch.equal(got[k], g[k]) for k in g)
