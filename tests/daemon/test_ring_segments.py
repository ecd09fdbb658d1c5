"""The on-disk ring's segments (issue 23), with real files: rotation and pruning keep the files on
disk bounded by the window (+ one segment) while every step recovery needs is there; a write that
fails halfway (a file size limit, as a full disk fails) leaves only whole records and later steps
are still written; a hostile segment costs only the records from it on, not its ring's earlier
records nor the other rings of the run."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.ringformat import segment_steps
from sentineld.contracts.capture import open_capture
from sentineld.contracts.ringrecord import scan_segment
from sentineld.contracts.rng import capture_rng
from sentineld.daemon.ring_recovery import recover_ring, recover_run

REPO = Path(__file__).resolve().parents[2]


def _on_disk(ring: Path) -> tuple[list[int], list[int], list[str]]:
    """(snapshot steps, step records of every segment, segment names) as the reader sees them."""
    snaps = sorted(int(p.name[5:-5]) for p in ring.glob("snap-*.ring"))
    steps, names = [], sorted(p.name for p in ring.glob("steps-*.ring"))
    for name in names:
        with open(ring / name, "rb") as f:
            scan = scan_segment(f, name)
        assert scan.damaged is None and scan.cut is None, scan
        steps += [r.header["step"] for r in scan.records]
    return snaps, steps, names


def _snap(step: int) -> SimpleNamespace:
    return SimpleNamespace(step=step, state={"model": {"w": torch.full((4,), float(step))}}, wait=lambda: None)


def _step(n: int, width: int = 16) -> SimpleNamespace:
    g = torch.Generator().manual_seed(n)
    return SimpleNamespace(step=n, batch=(torch.randn(8, width, generator=g), torch.randint(0, 3, (8,), generator=g)),
                           rng=capture_rng(), record={"kind": "step", "step": n, "loss": 1.0 / (n + 1)})


def test_rotation_and_pruning_bound_the_files_over_300_steps(tmp_path: Path) -> None:
    window, every = 64, 50
    k = segment_steps(window)
    assert k == 16
    w = DiskRingWriter(tmp_path, rank=0, window=window, run_id="bound", torch_version=torch.__version__)
    snaps_taken: list[int] = []
    most_files = 0
    try:
        for n in range(300):
            if n % every == 0:
                w.add_snapshot(_snap(n))
                snaps_taken.append(n)
            w.add_step(_step(n))
            w.flush()
            snaps, steps, names = _on_disk(w.dir)
            most_files = max(most_files, len(names) + len(snaps))
            assert snaps == snaps_taken[-2:], n
            # Every step recovery needs: the newest `window`, none before the older snapshot...
            need = set(range(max(snaps[0], n - window + 1), n + 1))
            assert need <= set(steps), (n, sorted(need - set(steps)))
            # ...and no more than what shares a segment with them: at most K - 1 more.
            assert steps == list(range(steps[0], n + 1)), n
            assert len(steps) <= len(need) + k - 1, (n, len(steps), len(need))
            assert len(names) <= (window + k - 1) // k + 1, (n, names)
            assert names[0] == f"steps-{steps[0]:09d}.ring"  # named after its first step
    finally:
        w.close(remove=False)
    assert w.failures == 0 and w.dropped == 0 and w.written == 300 + len(snaps_taken)
    assert most_files <= 2 + (window + k - 1) // k + 1
    cap = recover_ring(w.dir)
    with open_capture(cap) as c:
        assert c.snapshot_step == 250 and c.steps == list(range(250, 300))
        torch.testing.assert_close(c.step(299).batch[0], _step(299).batch[0])
        assert [r["step"] for r in c.records()] == c.steps


WRITER_UNDER_A_FILE_SIZE_LIMIT = """
import json, resource, signal, sys, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_ring_segments import _snap, _step
from sentineld.agent.diskring import DiskRingWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as a full disk gives ENOSPC: a write cut short
warnings = []
w = DiskRingWriter(Path({run!r}), rank=0, window=64, run_id="fsize", torch_version=torch.__version__,
                   on_warning=warnings.append)
w.add_snapshot(_snap(0))
w.add_step(_step(0, width=64))
w.flush()
record = next(w.dir.glob("steps-*.ring")).stat().st_size - 10  # the magic is 10 bytes
limit = 10 + 6 * record + record // 2  # 6 records fit in a file, the 7th is cut short
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
for n in range(1, 40):
    w.add_step(_step(n, width=64))
    w.flush()
w.close(remove=False)
print(json.dumps({{"dir": str(w.dir), "failures": w.failures, "written": w.written, "warnings": warnings,
                   "limit": limit}}))
"""


def test_a_write_cut_short_by_a_full_file_leaves_whole_records_and_later_steps_written(tmp_path: Path) -> None:
    """A segment that reaches the limit mid-record: the writer cuts it back to its last whole
    record and goes on in a new segment; one warning; the reader finds no partial record."""
    code = WRITER_UNDER_A_FILE_SIZE_LIMIT.format(tests=str(Path(__file__).parent), run=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    ring = Path(res["dir"])
    _, steps, names = _on_disk(ring)  # asserts: no segment cut short or damaged
    failed = [6, 13, 20, 27, 34]  # the 7th step of each segment
    assert steps == [n for n in range(40) if n not in failed], steps
    assert res["failures"] == len(failed) and res["written"] == 1 + 40 - len(failed), res
    assert len(res["warnings"]) == 1 and "write failed" in res["warnings"][0], res["warnings"]
    assert all((ring / n).stat().st_size < res["limit"] for n in names)
    cap = recover_ring(ring)  # the steps after the snapshot, up to the first gap
    with open_capture(cap) as c:
        assert c.steps == list(range(6))
        for n in c.steps:
            torch.testing.assert_close(c.step(n).batch[0], _step(n, width=64).batch[0])


def test_a_hostile_segment_costs_its_records_from_there_on_only(tmp_path: Path, caplog) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    rings = []
    for rank in (0, 1):  # two processes of one run; rank 1's ring is tampered with
        w = DiskRingWriter(run_dir, rank=rank, window=32, run_id="hostile", torch_version=torch.__version__)
        w.add_snapshot(_snap(0))
        for n in range(20):
            w.add_step(_step(n))
        w.flush()
        w.close(remove=False)
        rings.append(w.dir)
    _, _, names = _on_disk(rings[1])
    assert names == ["steps-000000000.ring", "steps-000000008.ring", "steps-000000016.ring"]  # K = 8
    seg = rings[1] / names[1]
    with open(seg, "rb") as f:
        recs = scan_segment(f, seg.name).records
    data = bytearray(seg.read_bytes())
    # Step 10's record: its first tensor now lies past its body (its CRC recomputed, as a hostile
    # writer would): refused, as is all that follows in that segment (11..15); 16.. are fine but
    # no longer contiguous with step 9.
    rec = recs[2]
    header = dict(rec.header, batch=dict(rec.header["batch"], tensors=[
        [*t[:3], t[3] + 10**6, t[4]] for t in rec.header["batch"]["tensors"]]))
    head = json.dumps(header).encode()
    crc = zlib.crc32(head, zlib.crc32(struct.pack("<IQ", len(head), rec.body_len)))
    rec_at = recs[1].end
    body = bytes(data[rec.body_at:rec.body_at + rec.body_len])
    data[rec_at:rec.end] = (struct.pack("<4sIQI", b"SREC", len(head), rec.body_len, crc) + head + body
                            + struct.pack("<I4s", crc, b"SEND"))
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="sentineld.diskring"):
        caps = sorted(recover_run(run_dir))
    assert [p.name for p in caps] == ["capture-rank0-step000000019-crash.h5", "capture-rank1-step000000009-crash.h5"]
    with open_capture(caps[0]) as c:
        assert c.steps == list(range(20))
    with open_capture(caps[1]) as c:
        assert c.steps == list(range(10))  # every good record before the hostile one
        for n in c.steps:
            torch.testing.assert_close(c.step(n).batch[0], _step(n).batch[0])
    said = [r.getMessage() for r in caplog.records if "steps-000000008.ring" in r.getMessage()]
    assert len(said) == 1 and "lies outside its record's body" in said[0] and f"at byte {rec_at}" in said[0], said
    assert not any(d.exists() for d in rings)
