"""The on-disk ring's records (sentineld.contracts.ringrecord, layout in ringformat's docstring),
read back from real files: a record a kill cut short, at any byte, is ignored and nothing before it
is lost; a record that is not what the agent writes (hostile lengths, a huge header, JSON that is
not an object, tensors outside the body) is refused with a message saying why, and the records
before it are kept."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.capture import open_capture
from sentineld.contracts.ringrecord import MAGIC, MAX_RECORD_HEADER, scan_segment
from sentineld.contracts.rng import capture_rng
from sentineld.daemon.ring_recovery import recover_ring


def _ring(run_dir: Path, steps: range, window: int = 64) -> tuple[DiskRingWriter, dict[int, tuple]]:
    """A real ring left as a killed process leaves it: snapshot ``steps[0]``, then ``steps``;
    returns the writer and each step's batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w = DiskRingWriter(run_dir, rank=0, window=window, run_id=run_dir.name, torch_version=torch.__version__)
    w.add_snapshot(SimpleNamespace(step=steps[0], state={"model": model.state_dict()}, wait=lambda: None))
    batches = {}
    for n in steps:
        batches[n] = (torch.randn(2, 3), torch.randint(0, 2, (2,)))
        w.add_step(SimpleNamespace(step=n, batch=batches[n], rng=capture_rng(),
                                   record={"kind": "step", "step": n, "loss": 0.5 + n}))
        w.flush()
    w.close(remove=False)
    return w, batches


def _scan(path: Path):
    with open(path, "rb") as f:
        return scan_segment(f, path.name)


def test_a_record_cut_short_at_any_byte_leaves_exactly_the_whole_records_before_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "cut"
    run_dir.mkdir()
    w, batches = _ring(run_dir, range(0, 3))
    [seg] = sorted(w.dir.glob("steps-*.ring"))
    data = seg.read_bytes()
    whole = _scan(seg)
    assert [r.header["step"] for r in whole.records] == [0, 1, 2] and whole.cut is None and whole.damaged is None
    start, end = whole.records[1].end, whole.records[2].end
    assert end == len(data) and data[:len(MAGIC)] == MAGIC
    for cut in reversed(range(start, end)):  # every byte boundary of the last record
        os.truncate(seg, cut)
        got = _scan(seg)
        assert [r.header["step"] for r in got.records] == [0, 1], cut
        assert got.damaged is None, (cut, got.damaged)
        assert (got.cut is None) == (cut == start), (cut, got.cut)
        if cut > start:
            assert f"the record at byte {start} runs past the end of the file" in got.cut
    for cut in range(0, len(MAGIC) + 1):  # the segment's own magic cut short: no record, no damage
        seg.write_bytes(data[:cut])
        assert _scan(seg).records == [] and _scan(seg).damaged is None

    # Recovery of a ring whose last record is cut (in the header, the body, the trailer): the
    # capture holds the whole steps before it, with the batches that were written.
    rec2 = whole.records[2]
    for cut in (start + 7, start + 30, rec2.body_at + 5, end - 1):
        d = run_dir / f"ring-rank0-{cut}"
        d.mkdir(mode=0o700)
        for f in w.dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / seg.name).write_bytes(data[:cut])
        cap_path = recover_ring(d)
        assert cap_path is not None and not d.exists()
        with open_capture(cap_path) as cap:
            assert cap.steps == [0, 1] and cap.first_step == 1
            for n in (0, 1):
                torch.testing.assert_close(cap.step(n).batch[0], batches[n][0])
                torch.testing.assert_close(cap.step(n).batch[1], batches[n][1])
            assert [r["step"] for r in cap.records()] == [0, 1]
        cap_path.unlink()


def _raw(head: bytes, body: bytes = b"", *, mark: bytes = b"SREC", hlen: int | None = None, blen: int | None = None,
         crc: int | None = None, end: bytes = b"SEND") -> bytes:
    """A record laid out as ringformat's docstring says, lengths and CRC as given (else right)."""
    hlen = len(head) if hlen is None else hlen
    blen = len(body) if blen is None else blen
    c = zlib.crc32(head[:hlen], zlib.crc32(struct.pack("<IQ", hlen, blen))) if crc is None else crc
    return struct.pack("<4sIQI", mark, hlen, blen, c) + head + body + struct.pack("<I4s", c, end)


def _step_head(tensors: list, rng: object = None, **extra: object) -> bytes:
    return json.dumps({"kind": "step", "step": 7, "record": None, "rng": rng,
                       "batch": {"tree": {"t": 0}, "tensors": tensors}, **extra}).encode()


F4 = ["float32", "<f4", [2], 0, 8]  # a float32[2] at body offset 0
HOSTILE = {
    "no marker": (_raw(_step_head([F4]), b"\0" * 8, mark=b"XXXX"), "no record marker"),
    "huge header": (_raw(b"{}", hlen=2**32 - 1), f"over the {MAX_RECORD_HEADER}-byte limit"),
    "header length outside the file": (_raw(_step_head([F4]), b"\0" * 8, hlen=1 << 20, crc=0),
                                       "runs past the end of the file"),
    "header length inside, CRC fixed": (_raw(_step_head([F4]), b"\0" * 8, hlen=20), "no trailer where"),
    "body length outside the file": (_raw(_step_head([F4]), b"\0" * 8, blen=1 << 40),
                                     "runs past the end of the file"),
    "body length inside, CRC fixed": (_raw(_step_head([F4]), b"\0" * 8, blen=4), "no trailer where"),
    "header altered": (_raw(_step_head([F4]), b"\0" * 8, crc=12345), "CRC does not match"),
    "JSON not an object": (_raw(b"[1, 2]"), "not a JSON object"),
    "not JSON": (_raw(b"\xff{"), "not JSON"),
    "nested too deep": (_raw(b"[" * 300 + b"]" * 300), "nests too deeply"),
    "tensor outside the body": (_raw(_step_head([["float32", "<f4", [2], 4, 8]]), b"\0" * 8),
                                "outside its record's body"),
    "tensor size not its shape": (_raw(_step_head([["float32", "<f4", [3], 0, 8]]), b"\0" * 12),
                                  "does not match its shape"),
    "negative offset": (_raw(_step_head([["float32", "<f4", [0], -4, 0]]), b"\0" * 8), "does not match its shape"),
    "object dtype": (_raw(_step_head([["float32", "|O", [1], 0, 8]]), b"\0" * 8), "not a plain numeric"),
    "shape not sizes": (_raw(_step_head([["float32", "<f4", [True, 2], 0, 8]]), b"\0" * 8), "shape is not"),
    "rng array outside": (_raw(_step_head([F4], rng={"meta": {}, "arrays": {"cpu": ["|u1", [9], 0, 9]}}),
                               b"\0" * 8), "outside its record's body"),
    "no step number": (_raw(json.dumps({"kind": "step", "step": True}).encode()), "no step number"),
    "unknown kind": (_raw(json.dumps({"kind": "exec", "step": 1}).encode()), "not step or snap"),
    "batch not a tree": (_raw(json.dumps({"kind": "step", "step": 1, "batch": [1]}).encode()), "not a packed tree"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_record_not_written_by_the_agent_is_refused_and_the_records_before_it_kept(tmp_path: Path,
                                                                                     case: str) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    w, _ = _ring(run_dir, range(0, 2))
    [seg] = sorted(w.dir.glob("steps-*.ring"))
    good = seg.read_bytes()
    first = _scan(seg).records
    bad, why = HOSTILE[case]
    # A good record, the hostile one, then a good one again: nothing after the hostile one is read.
    seg.write_bytes(good[:first[0].end] + bad + good[first[0].end:])
    got = _scan(seg)
    assert [r.header["step"] for r in got.records] == [0], case
    problem = got.damaged or got.cut
    assert problem is not None and why in problem, (case, got)
    assert f"byte {first[0].end}" in problem and seg.name in problem
    if "runs past the end" not in why:
        assert got.damaged and got.cut is None


def test_a_file_of_the_previous_layout_is_named_as_such(tmp_path: Path) -> None:
    old = tmp_path / "steps-000000001.ring"
    old.write_bytes(b"SNTLRING1\n" + (10).to_bytes(8, "little") + b'{"kind": 1}')
    got = _scan(old)
    assert got.records == [] and "older sentineld" in got.damaged
    other = tmp_path / "steps-000000002.ring"
    other.write_bytes(b"GIF89a" + b"\0" * 100)
    assert "not an on-disk ring file" in _scan(other).damaged
