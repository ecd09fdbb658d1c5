"""RunDir owns every name in a run directory: what it writes, its own patterns recognise."""

from __future__ import annotations

from sentineld.contracts.rundir import RunDir


def test_names_round_trip(tmp_path):
    rd = RunDir(tmp_path)
    cap = rd.capture(3, 42, "nonfinite")
    assert cap.name == "capture-rank3-step000000042-nonfinite.h5"
    assert RunDir.parse_capture_name(cap.name) == (3, 42, "nonfinite")
    assert RunDir.parse_capture_name(cap.name + ".tmp") is None
    assert RunDir.stream_rank(rd.stream(7).name) == 7
    assert RunDir.stream_rank("stream-rank7.jsonl.tmp") is None
    for n in (0, 2):
        m = RunDir.RING.match(rd.ring_name(1, 1234, n))
        assert m is not None and (m.group(1), m.group(2)) == ("1", "1234")
    assert RunDir.meta_name(0) == "run.json" and RunDir.meta_name(2) == "run-rank2.json"


def test_listing_sorts_by_step_then_rank_and_skips_temp_files(tmp_path):
    rd = RunDir(tmp_path)
    for rank, step in ((1, 5), (0, 5), (0, 2)):
        rd.capture(rank, step, "crash").write_bytes(b"")
    (tmp_path / (rd.capture_name(0, 9, "nonfinite") + ".tmp")).write_bytes(b"")
    (tmp_path / rd.ring_name(0, 99)).mkdir()
    assert [(r, s) for r, s, _t, _p in rd.captures()] == [(0, 2), (0, 5), (1, 5)]
    assert [p.name for p in rd.unfinished_captures(0)] == [rd.capture_name(0, 9, "nonfinite") + ".tmp"]
    assert [p.name for p in rd.ring_dirs()] == ["ring-rank0-99"]
