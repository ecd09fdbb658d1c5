"""The daemon reads a dead process's ring, files its owner controls, without being killed or
exhausted by them (issue 23's review of the segment format): a snapshot or segment cut short while
recovery reads it is an error, never a SIGBUS (the bodies are private copies, not mappings of her
files); a sparse file's terabyte length costs the daemon no memory; a listing of hundreds of
planted segment files costs it no descriptors and no scans."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.capture import open_capture
from sentineld.contracts.ringformat import MAX_SEGMENT_STEPS
from sentineld.contracts.ringrecord import MAGIC, scan_segment
from sentineld.contracts.rng import capture_rng
from sentineld.contracts.safeio import SafeDir
from sentineld.daemon import ring_recovery
from sentineld.daemon.ring_recovery import MAX_SEGMENTS, recover_ring

REPO = Path(__file__).resolve().parents[2]


def _ring(run_dir: Path, steps: int = 12, width: int = 4096) -> tuple[Path, dict[int, torch.Tensor]]:
    """A real ring as a killed process leaves it (snapshot 0, steps 0..steps-1); its batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 64)  # a 1 MiB snapshot: mapped pages a truncation would fault
    w = DiskRingWriter(run_dir, rank=0, window=64, run_id=run_dir.name, torch_version=torch.__version__)
    w.add_snapshot(SimpleNamespace(step=0, state={"model": model.state_dict()}, wait=lambda: None))
    batches = {}
    for n in range(steps):
        batches[n] = torch.randn(4, 8)
        w.add_step(SimpleNamespace(step=n, batch=(batches[n],), rng=capture_rng(),
                                   record={"kind": "step", "step": n, "loss": 1.0}))
    w.flush()
    w.close(remove=False)
    return w.dir, batches


def test_a_snapshot_cut_short_after_it_was_read_is_no_sigbus(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir)
    snap = ring / "snap-000000000.ring"
    # In a child: a SIGBUS (what a mapping of the ring's own file gave) kills the process, no
    # exception to catch; the child's exit status tells it apart from a Python error.
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from sentineld.contracts.ringrecord import read_ring_file
        from sentineld.contracts.safeio import SafeDir
        path = Path({str(snap)!r})
        header, body, mm = read_ring_file(path, SafeDir.open(path.parent))
        before = bytes(body[-4096:])
        os.truncate(path, 100)                 # its owner cuts it short under the reader
        assert bytes(body[-4096:]) == before   # the copy is the daemon's own
        print(len(body))
    """)
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])
    assert int(got.stdout) > 1 << 20


def test_a_segment_cut_short_between_the_scan_and_the_read_is_a_clean_error(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir)
    read_step = ring_recovery._read_step

    def cut_first(r: SafeDir, ref: ring_recovery._StepRef):  # the owner truncates as the capture is written
        os.truncate(ring / ref.name, ref.rec.body_at + 10)
        return read_step(r, ref)
    monkeypatch.setattr(ring_recovery, "_read_step", cut_first)
    with pytest.raises(ValueError, match="changed since recovery read it|changed while being read"):
        recover_ring(ring)
    assert not list(run_dir.glob("capture-*.h5"))  # whole or absent
    assert ring.exists()                           # kept for another try


def _sparse_step(ring: Path, step: int, blen: int) -> None:
    """Plant step ``step``'s record with a body of ``blen`` bytes (one float32 tensor), the trailer
    there: a sparse file, that long at no cost of disk to its owner, every check passing."""
    head = json.dumps({"kind": "step", "step": step, "record": None,
                       "batch": {"tree": {"t": 0}, "tensors": [["float32", "<f4", [blen // 4], 0, blen]]}}).encode()
    crc = zlib.crc32(head, zlib.crc32(struct.pack("<IQ", len(head), blen)))
    seg = ring / f"steps-{step:09d}.ring"
    with open(seg, "wb") as f:
        f.write(MAGIC + struct.pack("<4sIQI", b"SREC", len(head), blen, crc) + head)
        f.seek(blen, os.SEEK_CUR)
        f.write(struct.pack("<I4s", crc, b"SEND"))
    os.chmod(seg, 0o600)
    with open(seg, "rb") as f:
        assert [r.body_len for r in scan_segment(f, seg.name).records] == [blen]


def test_a_sparse_body_beyond_the_free_disk_fails_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir, steps=2)
    _sparse_step(ring, 2, 1 << max(40, (2 * shutil.disk_usage(tmp_path).free).bit_length()))
    with pytest.raises(OSError, match="no space left on device"):
        recover_ring(ring)
    assert not list(run_dir.glob("capture-*.h5")) and ring.exists()


def test_a_sparse_body_the_disk_can_hold_costs_the_daemon_no_heap(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir, steps=2)
    _sparse_step(ring, 2, 256 << 20)
    # In a child whose heap may grow by 64 MiB only (RLIMIT_DATA: private memory; a file's
    # mapping is not counted): reading the 256 MiB body into the heap raised MemoryError.
    code = textwrap.dedent(f"""
        import resource, re
        from pathlib import Path
        from sentineld.daemon.ring_recovery import recover_ring
        from sentineld.contracts.capture import open_capture
        import h5py, numpy  # loaded before the limit
        vm = int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (vm + (64 << 20), resource.RLIM_INFINITY))
        cap = recover_ring(Path({str(ring)!r}))
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        with open_capture(cap) as c:
            print(c.steps, c.step(2).batch.numel())
    """)
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split() == ["[0,", "1,", "2]", str(64 << 20)]


def test_hundreds_of_planted_segment_files_cost_no_descriptors(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir, steps=2)
    for n in range(100, 100 + MAX_SEGMENTS + 1):
        p = ring / f"steps-{n:09d}.ring"
        p.write_bytes(MAGIC)
        os.chmod(p, 0o600)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match=f"more than the {MAX_SEGMENTS}"):
        recover_ring(ring)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert ring.exists()


def test_a_ring_still_recovers_to_the_batches_it_holds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, batches = _ring(run_dir, steps=40)
    fds = len(os.listdir("/proc/self/fd"))
    cap = recover_ring(ring)
    assert cap is not None and len(os.listdir("/proc/self/fd")) == fds
    with open_capture(cap) as c:
        assert c.steps == list(range(40))
        for n in c.steps:
            torch.testing.assert_close(c.step(n).batch[0], batches[n])


def test_a_segment_of_more_records_than_the_agent_writes_is_cut_at_the_limit(tmp_path: Path) -> None:
    # A planted segment of many tiny records: the scan stops at MAX_SEGMENT_STEPS (the most the
    # agent's writer puts in one), so it never lists millions; the records up to it are kept.
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    ring, _ = _ring(run_dir, steps=MAX_SEGMENT_STEPS)  # window 64: segments of 16
    (seg,) = [p for p in ring.glob("steps-*.ring") if p.name == "steps-000000000.ring"]
    other = ring / "steps-000000016.ring"
    body = other.read_bytes()[len(MAGIC):]
    seg.write_bytes(seg.read_bytes() + body * 3)  # 16 + 48 records, steps 0..15 then 16..31 x 3
    with open(seg, "rb") as f:
        scan = scan_segment(f, seg.name, MAX_SEGMENT_STEPS)
    assert len(scan.records) == MAX_SEGMENT_STEPS and "more than 32 records" in (scan.damaged or "")
    with open(seg, "rb") as f:
        assert len(scan_segment(f, seg.name).records) == 64  # without the limit: every one
