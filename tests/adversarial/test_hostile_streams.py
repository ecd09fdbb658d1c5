"""A second local user (``sntl_mallory``, a real Unix account) against a root daemon watching a
shared 1777 runs dir, through the stream files of her run dir.

Before: a 64 GiB sparse ``stream-rank0.jsonl`` without a newline (free to make: ``truncate``) was
read whole by the daemon's main loop on every scan, looking for the end of one line; no other run
was read meanwhile, so our NaN run got no alert and ``status.json`` was never written. Now a line
is scanned at most ``MAX_LINE_BYTES`` (then skipped as one damaged line), and a stream unchanged
since a read that found nothing new is not read again. Her FIFO, ``/dev/zero`` link, link to a
root-only file and directory named like streams are refused as before (not read, not blocking).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import wait_until
from tests.reliability.conftest import make_daemon  # noqa: F401 - fixture
from tests.reliability.test_trust_runfiles import _copy_run, _shared_runs, template  # noqa: F401 - fixture
from tests.reliability.test_trust_users import as_mallory, mallory, shared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,  # a real training subprocess and daemon
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]


def test_her_streams_never_stall_the_daemon(mallory, shared, template, make_daemon):  # noqa: F811
    runs = _shared_runs(shared)
    hers = runs / "hers"  # sorted before ours: the main loop reaches her run first
    as_mallory(mallory, f"mkdir -m 777 {hers} && cd {hers} && truncate -s 64G stream-rank0.jsonl && "
                        "mkfifo stream-rank1.jsonl && ln -s /dev/zero stream-rank2.jsonl && "
                        "ln -s /etc/shadow stream-rank3.jsonl && mkdir stream-rank4.jsonl")
    _copy_run(template, runs / "ours", {"run_id": "ours", "recipe": None, "pid": 999999})
    t0 = time.monotonic()
    d = make_daemon(runs_dir=runs)  # waits for its first status.json
    notes = wait_until(lambda: [n for n in d.notifications() if n["run"] == "ours" and n["kind"] == "alert"],
                       30, "our run's alert")
    assert notes[0]["signature"] == "nonfinite"
    assert time.monotonic() - t0 < 30
    # Her absurd line was skipped with the rest of her file: the daemon does not go on reading
    # 64 GiB of zeros (at most one 16 MiB scan), and it keeps writing its status.
    first = d.status()["updated_s"]
    wait_until(lambda: d.status().get("updated_s", 0) > first, 10, "a later status.json")
    entry = next(r for r in d.status()["runs"] if r["run_id"] == "hers")
    assert entry["bad_lines"] == 1 and entry["ranks"] == [0, 1, 2, 3, 4]
    assert d.proc is not None
    io = f"/proc/{d.proc.pid}/io"
    before = int(next(x for x in open(io).read().splitlines() if x.startswith("rchar:")).split()[1])
    time.sleep(2.0)
    after = int(next(x for x in open(io).read().splitlines() if x.startswith("rchar:")).split()[1])
    assert after - before < 8 << 20
    t1 = time.monotonic()
    assert d.stop() == 0 and time.monotonic() - t1 < 15  # SIGTERM is heard promptly


def test_an_unchanged_partial_line_is_not_read_again(mallory, shared, make_daemon):  # noqa: F811
    """Many streams each ending in a 1 MiB partial line cost one read each, not one per scan."""
    runs = _shared_runs(shared)
    as_mallory(mallory, f"mkdir -m 777 {runs}/hers && cd {runs}/hers && i=0; while [ $i -lt 64 ]; do "
                        "head -c 2000000 /dev/zero | tr '\\0' x > stream-rank$i.jsonl; i=$((i+1)); done")
    d = make_daemon(runs_dir=runs, config={"poll_s": 0.2})
    wait_until(lambda: len(next((r for r in d.status().get("runs", []) if r["run_id"] == "hers"),
                                {"ranks": []})["ranks"]) == 64, 30, "her 64 ranks")
    assert d.proc is not None
    io = f"/proc/{d.proc.pid}/io"

    def read_bytes() -> int:
        return int(next(x for x in open(io).read().splitlines() if x.startswith("rchar:")).split()[1])

    before = read_bytes()
    time.sleep(3.0)  # about 15 scans: before, each re-read 64 x 2 MB
    assert read_bytes() - before < 20 << 20


def test_sentineld_runs_lists_a_shared_runs_dir_in_bounded_time(mallory, shared, template):  # noqa: F811
    """Before: ``sentineld runs`` read every stream whole: her 64 GiB sparse stream made the listing
    take minutes (44 s for 20 GiB here); now it reads the last 8 MiB of each stream."""
    import json
    import subprocess
    import sys

    runs = _shared_runs(shared)
    as_mallory(mallory, f"mkdir -m 755 {runs}/hers && truncate -s 64G {runs}/hers/stream-rank0.jsonl")
    _copy_run(template, runs / "ours", {"run_id": "ours"})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--runs-dir", str(runs), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 20
    rows = {row["run_id"]: row for row in json.loads(r.stdout)}
    assert rows["ours"]["last_step"] == 7 and rows["ours"]["state"] == "finished"
    assert rows["hers"]["ranks"] == [0] and rows["hers"]["last_step"] is None
