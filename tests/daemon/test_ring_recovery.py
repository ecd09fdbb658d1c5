"""Ring recovery writes its crash capture through the one capture writer (issue 9): a ring left by
a dead writer becomes the same file, dataset for dataset, as ``write_capture`` makes from the
same snapshot and steps, and recovery runs without torch (the daemon's process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.capture import CaptureStep, open_capture, write_capture
from sentineld.contracts.rng import capture_rng

REPO = Path(__file__).resolve().parents[2]


def _dump(path: Path) -> dict[str, Any]:
    """Every dataset (value, dtype, filters, attrs) and the root attrs but created_s/message."""
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as f:
        out["/"] = {k: v for k, v in f.attrs.items() if k not in ("created_s", "message")}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                val = obj[()]
                out[name] = (val.tobytes() if isinstance(val, np.ndarray) else val, str(obj.dtype),
                             obj.shape, obj.fletcher32, dict(obj.attrs))
            else:
                out[name] = dict(obj.attrs)

        f.visititems(visit)
    return out


def test_recovered_ring_is_what_the_capture_writer_writes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # optimizer state with tensors (exp_avg...) and ints
    snapshot = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(), "scheduler": None, "scaler": None}
    steps, records = [], []
    for n in range(5, 8):
        batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)), {"mask": torch.ones(3, dtype=torch.bool)})
        steps.append(CaptureStep(n, batch, capture_rng()))
        records.append({"kind": "step", "step": n, "loss": float("nan") if n == 7 else 0.5 + n})
        torch.rand(1)  # each step's RNG state differs
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    ring = DiskRingWriter(run_dir, rank=0, window=10, run_id="r1", torch_version=torch.__version__)
    ring.add_snapshot(SimpleNamespace(step=5, state=snapshot, wait=lambda: None))
    for st, rec in zip(steps, records):
        ring.add_step(SimpleNamespace(step=st.step, batch=st.batch, rng=st.rng, record=rec))
    ring.flush()
    ring.close(remove=False)  # as a killed process leaves it: lock free, files there

    # Recovery as the daemon runs it: a process where torch cannot be imported.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pathlib import Path\nfrom sentineld.daemon.ring_recovery import recover_ring\n"
            f"print(recover_ring(Path({str(ring.dir)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    recovered = Path(out.stdout.strip().splitlines()[-1])
    assert recovered == run_dir / "capture-rank0-step000000007-crash.h5", recovered
    assert not ring.dir.exists()

    expected = write_capture(tmp_path / "expected.h5", run_id="r1", rank=0, trigger="crash", first_step=7,
                             snapshot_step=5, snapshot=snapshot, steps=steps, records=records)
    got, want = _dump(recovered), _dump(expected)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], (name, got[name], want[name])
    with open_capture(recovered) as cap:
        assert cap.trigger == "crash" and cap.steps == [5, 6, 7]
        assert "died without closing the agent" in cap.message
        assert json.dumps(cap.records()) == json.dumps(records)
        torch.testing.assert_close(cap.snapshot()["model"], snapshot["model"])
        torch.testing.assert_close(cap.step(6).batch[0], steps[1].batch[0])
