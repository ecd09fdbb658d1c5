"""Issue 15, item 5: the smaller holes the adversary found on d9bb298, each with its input."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from sentineld.contracts.capture import CaptureError, CaptureStep, open_capture, write_capture
from sentineld.daemon.ring_recovery import recover_ring
from sentineld.daemon.runwatch import RunWatch, stale_temp_captures
from tests.conftest import REPO

from .checks import write_run

CLI = [sys.executable, "-m", "sentineld"]


def _capture(tmp_path: Path) -> Path:
    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    step = CaptureStep(step=3, batch=(torch.ones(8, 64), torch.zeros(8, dtype=torch.long)), rng=None)
    return write_capture(tmp_path / "capture-rank0-step000000003-nonfinite.h5", run_id="r", rank=0,
                         trigger="nonfinite", first_step=3, snapshot_step=3,
                         snapshot={"model": {"w": w}, "optimizer": {}}, steps=[step], records=[{"step": 3}])


def _flip_byte_in(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        off = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(off + 100)
        b = fh.read(1)
        fh.seek(off + 100)
        fh.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_bit_is_reported_as_corruption(tmp_path):
    """d9bb298 had no checksums: bit flips gave 'not reproduced', once a wrong localization."""
    cap = _capture(tmp_path)
    with open_capture(cap) as c:
        assert torch.equal(c.snapshot()["model"]["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64))
        name = next(f"snapshot/{k}" for k in c._f["snapshot"] if k != "tree")
    _flip_byte_in(cap, name)
    with open_capture(cap) as c, pytest.raises(CaptureError, match="corrupted"):
        c.snapshot()


def test_a_string_dataset_altered_after_writing_is_corruption(tmp_path):
    cap = _capture(tmp_path)
    with h5py.File(cap, "r+") as f:
        crc = f["records"].attrs["crc32"]
        del f["records"]
        f.create_dataset("records", data='[{"step": 3, "loss": 1.0}]').attrs["crc32"] = crc
    with open_capture(cap) as c, pytest.raises(CaptureError, match="checksum"):
        c.records()


def test_a_capture_declaring_a_huge_dataset_is_refused_before_reading(tmp_path):
    """d9bb298: a 721 kB capture declaring an unwritten 60000x60000 gzip dataset took 14.4 GB."""
    cap = _capture(tmp_path)
    with h5py.File(cap, "r+") as f:
        name = next(k for k in f["snapshot"] if k != "tree")
        del f["snapshot"][name]
        f["snapshot"].create_dataset(name, shape=(60000, 60000), dtype="f4", compression="gzip")
        f["snapshot"][name].attrs["torch_dtype"] = "float32"
    assert cap.stat().st_size < 1 << 20
    t0 = time.monotonic()
    with open_capture(cap) as c, pytest.raises(CaptureError, match="declares"):
        c.snapshot()
    assert time.monotonic() - t0 < 5


def test_recovery_never_deletes_through_a_symlinked_ring(tmp_path):
    """d9bb298: a `ring-rank0-*` symlink made the daemon delete a file where it pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "precious.tmp"
    victim.write_text("keep me")
    (elsewhere / "lock").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "ring-rank0-4242").symlink_to(elsewhere)
    with pytest.raises(OSError, match="not an on-disk ring sentineld can trust"):  # left alone
        recover_ring(run / "ring-rank0-4242")
    assert victim.read_text() == "keep me"


def test_stale_temp_captures_of_dead_processes_only(tmp_path):
    run_dir = write_run(tmp_path / "runs", "tmpclean", 5)
    rw = RunWatch(run_dir)
    rw.poll()
    dead = run_dir / "capture-rank0-step000000004-nonfinite.h5.tmp"
    dead.write_bytes(b"\0" * 1000)
    old = time.time() - 120
    os.utime(dead, (old, old))
    link = run_dir / "capture-rank0-step000000005-nonfinite.h5.tmp"
    link.symlink_to(tmp_path / "not-ours")
    host = rw.hosts[0]
    assert stale_temp_captures(rw, time.time(), host, alive=lambda pid: False) == [dead]
    assert stale_temp_captures(rw, time.time(), host, alive=lambda pid: True) == []  # still writing
    assert stale_temp_captures(rw, time.time(), "other-host", alive=lambda pid: False) == []
    assert stale_temp_captures(rw, old + 30, host, alive=lambda pid: False) == []  # too young


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_long_names_and_a_runs_dir_that_is_a_file_give_errors_not_tracebacks(tmp_path):
    for run in ("x" * 300, str(tmp_path / ("a" * 5000))):
        out = _run([*CLI, "replay", run, "--runs-dir", str(tmp_path)])
        assert out.returncode == 2 and "Traceback" not in out.stderr and "no run" in out.stderr, out.stderr
    afile = tmp_path / "runs-file"
    afile.write_text("not a dir")
    out = _run([*CLI, "start", "--foreground", "--state-dir", str(tmp_path / "st")],
               env={"SENTINELD_RUNS_DIR": str(afile)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "not a directory" in out.stderr


def test_state_dirs_and_the_lock_are_private(tmp_path):
    """d9bb298: daemon.lock 0644; ~/.local and ~/.local/state created 0755."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    env = {"HOME": str(home), "XDG_STATE_HOME": "", "XDG_CONFIG_HOME": "", "SENTINELD_RUNS_DIR": str(tmp_path / "runs")}
    env = {k: v for k, v in env.items()}
    full_env = {k: v for k, v in {**os.environ, **env}.items() if not (k.startswith("XDG_") and not v)}
    out = subprocess.run([*CLI, "status"], capture_output=True, text=True, timeout=60, cwd=REPO, env=full_env)
    assert out.returncode == 3, out.stderr  # no daemon
    out = subprocess.run([*CLI, "start"], capture_output=True, text=True, timeout=60, cwd=REPO, env=full_env)
    try:
        assert out.returncode == 0, out.stderr
        state = home / ".local" / "state" / "sentineld"
        for d in (home / ".local", home / ".local" / "state", state):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        lock = state / "daemon.lock"
        assert lock.exists() and stat.S_IMODE(lock.stat().st_mode) == 0o600
    finally:
        subprocess.run([*CLI, "stop"], capture_output=True, text=True, timeout=60, cwd=REPO, env=full_env)


def test_dataset_limits_leave_real_captures_alone(tmp_path):
    # Zeros compress well and would look "huge" to a ratio on compressed size: ours are not compressed.
    cap = write_capture(tmp_path / "capture-rank0-step000000001-manual.h5", run_id="r", rank=0, trigger="manual",
                        first_step=1, snapshot_step=1, snapshot={"model": {"w": torch.zeros(512, 512)}},
                        steps=[CaptureStep(step=1, batch=np.zeros((4, 4), dtype=np.float32), rng=None)],
                        records=[])
    with open_capture(cap) as c:
        assert c.snapshot()["model"]["w"].abs().sum().item() == 0.0
        assert c.step(1).batch.shape == (4, 4)
