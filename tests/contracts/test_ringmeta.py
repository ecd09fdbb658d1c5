"""The on-disk ring's ``meta.json`` is one contract (sentineld.contracts.ringformat.RingMeta):
the agent's writer produces it, the daemon's recovery and its recover loop parse it, and a file
another process left there (wrong types, not an object, too deep, a FIFO) never breaks a reader."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from sentineld.agent.diskring import DiskRingWriter
from sentineld.contracts.ringformat import MAX_RING_META_BYTES, META_FILE, RingMeta, read_ring_meta
from sentineld.contracts.safeio import SafeDir


def test_the_agents_meta_reads_back_as_written(tmp_path: Path) -> None:
    ring = DiskRingWriter(tmp_path, rank=3, window=7, run_id="r-meta", torch_version=torch.__version__)
    try:
        raw = (ring.dir / META_FILE).read_bytes()
        with SafeDir.open(ring.dir) as d:
            got = read_ring_meta(d)
    finally:
        ring.close()
    assert got == RingMeta(rank=3, pid=os.getpid(), host=socket.gethostname(), window=7, run_id="r-meta",
                           torch_version=torch.__version__)
    assert json.loads(raw) == {"rank": 3, "pid": os.getpid(), "host": socket.gethostname(), "window": 7,
                               "run_id": "r-meta", "torch_version": torch.__version__}
    assert len(raw) < MAX_RING_META_BYTES


def test_a_field_of_another_type_reads_as_none() -> None:
    got = RingMeta.from_json(json.dumps({"rank": "0", "pid": True, "host": 5, "window": 2.5, "run_id": "x",
                                         "unknown": 1}))
    assert got == RingMeta(run_id="x")
    assert RingMeta.from_json(RingMeta(rank=1, host="h").to_json()) == RingMeta(rank=1, host="h")
    assert json.loads(RingMeta(rank=1).to_json()) == {"rank": 1}  # None fields are left out


@pytest.mark.parametrize("text", ["[1, 2]", "not json", "[" * 200 + "]" * 200, '"a string"'])
def test_not_a_meta_object_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        RingMeta.from_json(text)


def test_read_ring_meta_of_a_fifo_or_missing_file_is_empty(tmp_path: Path) -> None:
    with SafeDir.open(tmp_path) as d:
        assert read_ring_meta(d) == RingMeta()
        os.mkfifo(tmp_path / META_FILE)
        assert read_ring_meta(d) == RingMeta()  # never blocks on the FIFO
