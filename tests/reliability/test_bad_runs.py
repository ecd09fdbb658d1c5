"""Issue 15, items 2 and 3: no incident left unnotified, one bad run never stops the others.

Each case is what the adversary did on d9bb298, against a real daemon process: a run id reused
after its run dir was deleted (0 notifications for the second run, even after a restart), a
damaged run.json (its stream never read), run dirs crafted to crash, block or flood the daemon
(deep JSON, wrong types, FIFOs, symlinks to /dev/zero) placed before a healthy run in sort order,
and a full state disk (the main loop crashed every second; the alert came only after a restart).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until

from .checks import write_run


def _alerts(daemon, run: str) -> list[dict]:
    return [n for n in daemon.notifications() if n["kind"] == "alert" and n["run"] == run]


def test_a_run_id_reused_after_its_dir_was_deleted_is_a_new_run(make_daemon):
    daemon = make_daemon(extra=["--no-replay"])
    runs = daemon.runs_dir
    write_run(runs, "reused", 40, {12})
    wait_until(lambda: _alerts(daemon, "reused"), 30, "the first run's alert")
    shutil.rmtree(runs / "reused")
    time.sleep(1.5)
    write_run(runs, "reused", 40, {12})  # same id, same step: another run
    wait_until(lambda: len(_alerts(daemon, "reused")) == 2, 30, "the second run's alert")
    # The same again across a restart: the saved progress is of the old run.
    daemon.stop()
    shutil.rmtree(runs / "reused")
    write_run(runs, "reused", 40, {12})
    daemon.start()
    wait_until(lambda: len(_alerts(daemon, "reused")) == 3, 30, "the third run's alert after a restart")
    assert len({n["id"] for n in _alerts(daemon, "reused")}) == 3


def test_a_damaged_run_json_does_not_silence_the_run(make_daemon):
    daemon = make_daemon(extra=["--no-replay"])
    run_dir = write_run(daemon.runs_dir, "damaged", 40, {12})
    (run_dir / "run.json").write_text('{"run_id": "damaged", "schema_version": 1, ')  # cut short
    [alert] = wait_until(lambda: _alerts(daemon, "damaged"), 30, "the NaN alert of a run with a bad run.json")
    assert alert["signature"] == "nonfinite" and alert["step"] == 12
    st = wait_until(lambda: [r for r in daemon.status().get("runs", []) if r["run_id"] == "damaged"
                             and r["error"]], 30, "the run.json error in status")
    assert "run.json" in st[0]["error"]


def _bad_runs(runs: Path) -> dict[str, str]:
    """Crafted run dirs, all sorting before ``z-healthy``; returns name -> what is wrong."""
    made = {}
    d = write_run(runs, "a-deep", 30, {5})
    (d / "run.json").write_text("[" * 5000 + "]" * 5000)
    made["a-deep"] = "run.json nested 5000 deep (RecursionError on d9bb298)"
    d = write_run(runs, "b-type", 30, {5})
    meta = json.loads((d / "run.json").read_text())
    meta["world_size"] = "2"
    (d / "run.json").write_text(json.dumps(meta))
    made["b-type"] = "world_size as a string (TypeError on d9bb298)"
    d = write_run(runs, "c-fifo-meta", 30, {5})
    (d / "run.json").unlink()
    os.mkfifo(d / "run.json", 0o600)
    made["c-fifo-meta"] = "run.json is a FIFO (blocked the main thread on d9bb298)"
    d = write_run(runs, "d-fifo-stream", 30, {5})
    (d / "stream-rank0.jsonl").unlink()
    os.mkfifo(d / "stream-rank0.jsonl", 0o600)
    made["d-fifo-stream"] = "the stream is a FIFO"
    d = write_run(runs, "e-zero-stream", 30, {5})
    (d / "stream-rank0.jsonl").unlink()
    (d / "stream-rank0.jsonl").symlink_to("/dev/zero")
    made["e-zero-stream"] = "the stream is a symlink to /dev/zero (100% CPU on d9bb298)"
    d = write_run(runs, "f-zero-meta", 30, {5})
    (d / "run.json").unlink()
    (d / "run.json").symlink_to("/dev/zero")
    made["f-zero-meta"] = "run.json is a symlink to /dev/zero (memory exhausted on d9bb298)"
    return made


def test_bad_runs_never_stop_the_daemon_watching_the_others(make_daemon):
    daemon = make_daemon(extra=["--no-replay"])
    runs = daemon.runs_dir
    bad = _bad_runs(runs)
    write_run(runs, "z-healthy-nan", 30, {7})
    wait_until(lambda: _alerts(daemon, "z-healthy-nan"), 30, "the alert of the run sorting after the bad ones")
    assert daemon.proc.poll() is None
    by_run = wait_until(lambda: {r["run_dir"].rsplit("/", 1)[-1]: r for r in daemon.status().get("runs", [])
                                 if r["error"]} if len([r for r in daemon.status().get("runs", [])
                                                         if r["error"]]) >= len(bad) - 1 else None,
                        30, "the bad runs' errors in status")
    for name in ("a-deep", "c-fifo-meta", "d-fifo-stream", "e-zero-stream", "f-zero-meta"):
        assert name in by_run, (name, bad[name], sorted(by_run))
    assert "wrong type" in by_run["b-type"]["error"] and "world_size" in by_run["b-type"]["error"]
    assert "FIFO" in by_run["d-fifo-stream"]["error"] and "symbolic link" in by_run["e-zero-stream"]["error"]
    # The runs with a readable stream still get their NaN alerted, whatever their run.json.
    for name in ("a-deep", "b-type", "c-fifo-meta", "f-zero-meta"):
        wait_until(lambda: _alerts(daemon, name), 30, f"the NaN alert of {name} ({bad[name]})")
    # A daemon that spins on /dev/zero uses a core; this one idles.
    time.sleep(2.0)
    _rss, _hwm, cpu0 = daemon.rss_cpu()
    time.sleep(3.0)
    _rss, hwm, cpu1 = daemon.rss_cpu()
    assert cpu1 - cpu0 < 1.5, f"daemon used {cpu1 - cpu0:.2f} s CPU in 3 s"
    assert hwm < 400 << 20
    # `sentineld runs` lists every run, the bad ones with their error, without hanging.
    out = subprocess.run([sys.executable, "-m", "sentineld", "runs", "--runs-dir", str(runs), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = {Path(r["dir"]).name: r for r in json.loads(out.stdout)}
    assert set(rows) == {*bad, "z-healthy-nan"}
    assert all(rows[n]["error"] for n in bad), {n: rows[n]["error"] for n in bad}


@pytest.fixture
def small_state_disk(tmp_path):
    """A real 1 MiB tmpfs for the daemon's state dir (root, as in CI); skipped where refused."""
    m = tmp_path / "state"
    m.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(m)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs in CI: {r.stderr}")
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")
    yield m
    subprocess.run(["umount", "-l", str(m)], check=False)


def test_a_full_state_disk_holds_the_alert_and_sends_it_once_there_is_room(make_daemon, small_state_disk):
    daemon = make_daemon(extra=["--no-replay"])
    filler = small_state_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)  # fill what is left of the state disk
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    write_run(daemon.runs_dir, "full-disk", 40, {12})
    wait_until(lambda: "holding it in memory" in daemon.log.read_text(), 30, "the held-in-memory log line")
    time.sleep(3.0)
    assert daemon.proc.poll() is None
    log_text = daemon.log.read_text()
    assert log_text.count("daemon loop") == 0, log_text[-2000:]  # the main loop never crashed
    filler.unlink()
    t0 = time.monotonic()
    [alert] = wait_until(lambda: _alerts(daemon, "full-disk"), 20, "the alert after space was freed")
    assert alert["step"] == 12 and time.monotonic() - t0 < 10
    st = wait_until(lambda: daemon.status() if daemon.status().get("alerts_unwritten") == 0 else None, 20,
                    "status after the write")
    assert st["state_write_error"] is None


def test_a_failed_capture_and_an_agent_that_switched_off_are_paged(make_daemon):
    """d9bb298: a capture not written (disk full) showed only in status; an agent that switched
    itself off sent nothing, and the run went on unwatched."""
    daemon = make_daemon(extra=["--no-replay"])
    run_dir = write_run(daemon.runs_dir, "agent-says", 30, {20}, end=False)
    with open(run_dir / "stream-rank0.jsonl", "a") as f:
        f.write(json.dumps({"kind": "agent_warning", "step": 20, "message": "capture not written: [Errno 28] "
                            "no space left on device in /runs (12 bytes free, about 5 MB needed)"}) + "\n")
        f.write(json.dumps({"kind": "agent_error", "message": "OSError(28, 'No space left on device')"}) + "\n")
    notes = wait_until(lambda: {n["signature"]: n for n in _alerts(daemon, "agent-says")}
                       if len(_alerts(daemon, "agent-says")) >= 3 else None, 30, "three notifications")
    assert set(notes) == {"nonfinite", "capture_failed", "agent_stopped"}
    assert "no space left" in notes["capture_failed"]["body"] and notes["capture_failed"]["step"] == 20
    assert "switched itself off" in notes["agent_stopped"]["body"]
    daemon.stop()
    daemon.start()  # a restart re-reads the window, but pages nothing twice
    time.sleep(3)
    assert len(_alerts(daemon, "agent-says")) == 3
