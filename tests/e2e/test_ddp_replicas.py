"""DDP replica consistency (issue 25): a silent one-element change of one rank's replica is named
by the agent's replica check (checksums compared through the job's store every 25 steps, the
default) within 50 steps, with a ``replica_divergence`` capture on every rank; replicas that
stay equal raise nothing. Three ranks, so the changed one is the odd one out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO

TRAIN = Path(__file__).with_name("ddp_replica_train.py")
WORLD, CHANGE_RANK, CHANGE_STEP, STEPS, EVERY = 3, 1, 10, 30, 25


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("replicas")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(WORLD), str(TRAIN), str(runs), "rep", str(CHANGE_RANK), str(CHANGE_STEP), str(STEPS)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs


def _divergences(run: Path, rank: int) -> list[dict]:
    lines = [json.loads(x) for x in (run / f"stream-rank{rank}.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("kind") == "replica_divergence"]


@pytest.mark.slow
def test_silent_change_on_one_rank_is_named_within_50_steps(runs: Path) -> None:
    run = runs / "rep-silent"
    first_sample = (CHANGE_STEP // EVERY + 1) * EVERY  # the first sampled step after the change
    assert first_sample - CHANGE_STEP <= 50
    for r in range(WORLD):
        divs = _divergences(run, r)
        assert divs, f"rank {r} saw no divergence"
        d = divs[0]
        assert (d["step"], d["ranks"], d["parameter"]) == (first_sample, [CHANGE_RANK], "fc1.weight"), d
    caps = [(c[0], c[1], c[2]) for c in list_captures(run)]
    assert caps == [(r, first_sample, "replica_divergence") for r in range(WORLD)]


@pytest.mark.slow
def test_equal_replicas_raise_nothing(runs: Path) -> None:
    run = runs / "rep-clean"
    assert all(not _divergences(run, r) for r in range(WORLD))
    assert list_captures(run) == []


@pytest.mark.slow
def test_the_daemon_pages_the_real_run_once_and_queues_no_replay(runs: Path, tmp_path: Path) -> None:
    """The real agent's streams through the daemon's real RunWatch, Alerting and outbox: one
    critical ``replica_divergence`` alert naming rank 1, ``fc1.weight`` and the step; the clean
    run pages nothing; no replica capture is queued for a replay."""
    import threading  # noqa: PLC0415

    from sentineld.daemon.alerting import RANK_GRACE_S, Alerting  # noqa: PLC0415
    from sentineld.daemon.daemon_config import DaemonConfig  # noqa: PLC0415
    from sentineld.daemon.loops import ReplayThread, Stats  # noqa: PLC0415
    from sentineld.daemon.metrics import DaemonMetrics  # noqa: PLC0415
    from sentineld.daemon.notifier import Notifier  # noqa: PLC0415
    from sentineld.daemon.outbox import Outbox  # noqa: PLC0415
    from sentineld.daemon.runstate import RunState  # noqa: PLC0415
    from sentineld.daemon.runwatch import RunWatch  # noqa: PLC0415
    from tests.daemon.test_alerting import Clock  # noqa: PLC0415

    first_sample = (CHANGE_STEP // EVERY + 1) * EVERY
    for name, expect in (("rep-silent", [("replica_divergence", first_sample)]), ("rep-clean", [])):
        clock, outbox = Clock(), Outbox(tmp_path / name / "outbox")
        cfg = DaemonConfig(runs_dir=runs, state_dir=tmp_path / name / "state")
        notifier = Notifier(outbox, [], clock)
        alerting = Alerting(cfg, notifier, Stats(), save=lambda s: None, clock=clock)
        state = RunState(RunWatch(runs / name, window=200))
        new, _caps = state.watch.poll()
        if new:
            alerting.evaluate(state, live=False)
        clock.now += RANK_GRACE_S + 0.1
        for st, keys in alerting.due([state]):
            alerting.release(st, keys)
        sent = [n for n in outbox if n.kind == "alert"]
        assert [(n.signature, n.step) for n in sent] == expect, name
        if sent:
            assert sent[0].severity == "critical"
            assert f"rank(s) {CHANGE_RANK}" in sent[0].body and "'fc1.weight'" in sent[0].body
        replayer = ReplayThread(threading.Event(), cfg, tmp_path / name / "records", notifier, Stats(),
                                DaemonMetrics())
        replayer.offer(state.watch)
        assert replayer.jobs.qsize() == 0
