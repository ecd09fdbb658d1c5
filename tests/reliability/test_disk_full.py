"""A full disk while a capture is written: training goes on to its last step, the agent logs one
clear warning, and no partial capture is left. The disk is a real 1 MiB tmpfs (we are root in
CI); where mounting is not permitted the test falls back to RLIMIT_FSIZE on the training process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

from .checks import check_stream

HERE = Path(__file__).resolve().parent


@pytest.fixture
def small_disk(tmp_path):
    """Two 1 MiB tmpfs mounts (one per training process); None when mounting is refused."""
    mounts = [tmp_path / "disk-a", tmp_path / "disk-b"]
    done = []
    for m in mounts:
        m.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(m)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            break
        done.append(m)
    yield mounts if len(done) == 2 else None
    for m in done:
        subprocess.run(["umount", "-l", str(m)], check=False)


def _train(runs: Path, run_id: str, disk_ring: bool, fsize_limit: int | None) -> subprocess.Popen:
    # A 512-wide MLP with Adam: a capture is ~3.5 MB, it cannot fit in 1 MiB; the stream can.
    spec = dict(run_id=run_id, runs_dir=str(runs), steps=60, nan_at=20, hidden=512,
                agent={"snapshot_every": 10, "flush_s": 0.05, "disk_ring": disk_ring})
    preexec = None
    if fsize_limit is not None:
        import resource
        import signal

        def preexec() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    return subprocess.Popen([sys.executable, str(HERE / "zygote.py"), "--once", json.dumps(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_disk_full_during_capture_training_goes_on_one_warning_no_partial_file(small_disk, tmp_path):
    if small_disk is None:  # fallback: a per-process file size limit instead of a full disk
        disks, limit, how = [tmp_path / "a", tmp_path / "b"], 1 << 20, "RLIMIT_FSIZE"
    else:
        disks, limit, how = small_disk, None, "tmpfs"
    procs = {"capture": _train(disks[0] / "runs", "full", False, limit),
             "ring": _train(disks[1] / "runs", "full-ring", True, limit)}
    out = {k: p.communicate(timeout=180) for k, p in procs.items()}
    for k, p in procs.items():
        assert p.returncode == 0, out[k][1][-3000:]
    print(f"\nfull disk simulated with {how}")

    run = disks[0] / "runs" / "full"
    steps = check_stream(run / "stream-rank0.jsonl")
    assert len(steps) == 60  # training went on to its last step
    warnings = [ln for ln in out["capture"][1].splitlines() if ln.strip()]
    assert len(warnings) == 1, warnings
    assert "capture capture-rank0-step000000020-nonfinite.h5 not written" in warnings[0]
    assert "training continues" in warnings[0]
    if how == "tmpfs":
        assert "no space left on device" in warnings[0]
    assert sorted(p.name for p in run.iterdir()) == ["run.json", "stream-rank0.jsonl"]  # nothing partial
    stream = [json.loads(x) for x in (run / "stream-rank0.jsonl").read_text().splitlines()]
    assert [o["kind"] for o in stream if o["kind"] == "agent_warning"] == ["agent_warning"]

    # With the on-disk ring too: one warning from each writer, still no partial file anywhere.
    run = disks[1] / "runs" / "full-ring"
    assert len(check_stream(run / "stream-rank0.jsonl")) == 60
    warnings = [ln for ln in out["ring"][1].splitlines() if ln.strip()]
    assert len(warnings) == 2 and any("on-disk ring" in w for w in warnings), warnings
    assert not list(run.rglob("*.tmp")) and not list(run.glob("capture-*"))
    assert not list(run.glob("ring-*"))  # a clean finish removes the ring
