"""A finite loss spike in a run stepping hundreds of steps/s, watched by a real daemon process: the
``loss_spike`` alert reaches a loopback webhook naming the spiking step (issue 21).

On main at 86d47d4 (and 39512e2) the daemon judged only the last ``hold_steps`` (8) records at each
read of a stream, so a run writing more than 8 records between two reads had its spike captured by
the agent (whose own tracker fired) and never alerted: both tests timed out there waiting for the
alert.
The truth is known without the product: the batch of step ``AT`` has its labels flipped and its
inputs x10, the only such step of the run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.rundir import list_captures
from sentineld.signatures.spike import LossSpikeConfig
from tests.conftest import REPO, wait_until

AT = 700
STEPS = 900
POLL_S = 1.0  # the daemon's stream reads in the first test: one per second (polling observer)

TRAIN = f"""
import sys, torch, torch.nn.functional as F
from sentineld.agent import attach
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(m.parameters(), 0.1)
g = torch.Generator().manual_seed(1)
with attach(m, opt, run_id="fast-spike", runs_dir=sys.argv[1], metrics_port=0) as watch:
    for i in range({STEPS}):  # no sleep: as fast as the loop goes
        x = torch.randn(32, 8, generator=g)
        y = (x[:, 0] + x[:, 1] > 0).long()
        if i == {AT}:  # the planted fault: a corrupted batch, finite
            x, y = x * 10, 1 - y
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
"""


def _stream_steps_per_s(run_dir: Path) -> float:
    """Steps per second of the run as its stream recorded them (the test's premise)."""
    times = []
    for path in run_dir.glob("stream*.jsonl"):
        for line in path.read_text().splitlines():
            obj = json.loads(line)
            if obj.get("kind") == "step":
                times.append(float(obj["time_s"]))
    assert len(times) >= STEPS, f"expected {STEPS} step records, found {len(times)}"
    return (len(times) - 1) / max(times[-1] - times[0], 1e-9)


@pytest.mark.slow
def test_fast_run_spike_alert_names_the_step(daemon_factory, http_sink, tmp_path) -> None:
    """The user's case: the daemon reads the stream once per poll (the stat-polling observer of a
    network filesystem, every second), the run writes hundreds of records meanwhile. With inotify
    the daemon reads more often, and on main the alert came or not depending on where a read
    happened to end (passed once of two tries)."""
    port, sink = http_sink
    config = tmp_path / "daemon.toml"
    config.write_text(f"polling_observer = true\npoll_s = {POLL_S}\n")
    daemon = daemon_factory(notify=[f"json://127.0.0.1:{port}/hook"],
                            extra=["--no-replay", "--config", str(config)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", TRAIN, str(daemon.runs_dir)], cwd=REPO, check=True,
                   timeout=180, env=env)
    run_dir = daemon.runs_dir / "fast-spike"
    # the premise: the agent saw the spike (its SpikeTracker fired: a spike capture at AT), and the
    # run went far faster than one record per daemon read
    assert [(c[1], c[2]) for c in list_captures(run_dir)] == [(AT, "spike")]
    rate = _stream_steps_per_s(run_dir)
    print(f"fast-spike run: {rate:.0f} steps/s")
    # The premise is records per read, not a speed: at least 5 x hold_steps of them (issue 21 broke
    # at 20 steps/s), so the old daemon, judging only the last hold_steps of a read, would miss the
    # spike in at least 4 of 5 runs. A fixed `rate > 100` failed on a loaded 2-core box (this run
    # went 123 steps/s with the suite and three busy loops beside it; the test needs no speed).
    assert rate * POLL_S >= 5 * LossSpikeConfig().hold_steps, rate

    def spike_posts() -> list[str]:
        with sink.lock:
            return [f"{obj.get('title', '')}\n{obj.get('message', '')}" for _, _, obj in sink.posts
                    if isinstance(obj, dict) and "loss_spike" in f"{obj.get('title', '')} {obj.get('message', '')}"]

    posts = wait_until(spike_posts, 30, "the loss_spike alert at the webhook")
    got = re.search(r"loss spike at step (\d+)", posts[0])
    assert got, posts[0]
    assert abs(int(got.group(1)) - AT) <= 3, posts[0]
    note = next(n for n in daemon.notifications() if n["signature"] == "loss_spike")
    assert note["run"] == "fast-spike" and abs(note["step"] - AT) <= 3


@pytest.mark.slow
def test_backlog_spike_is_alerted_by_a_daemon_started_after_the_run(daemon_factory, http_sink, tmp_path) -> None:
    """The whole run (900 records) is a backlog the daemon catches up on in reads of 100: the
    spike inside one of them is alerted at its step (on main: never, it is not among the last 8
    of any read)."""
    port, sink = http_sink
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", TRAIN, str(runs)], cwd=REPO, check=True, timeout=180, env=env)
    assert [(c[1], c[2]) for c in list_captures(runs / "fast-spike")] == [(AT, "spike")]
    daemon = daemon_factory(notify=[f"json://127.0.0.1:{port}/hook"], extra=["--no-replay"], runs_dir=runs)
    note = wait_until(lambda: next((n for n in daemon.notifications() if n["signature"] == "loss_spike"), None),
                      30, "the loss_spike alert")
    assert note["run"] == "fast-spike" and abs(note["step"] - AT) <= 3
    wait_until(lambda: any(isinstance(obj, dict) and "loss_spike" in f"{obj.get('title')} {obj.get('message')}"
                           for _, _, obj in list(sink.posts)), 30, "the loss_spike alert at the webhook")
