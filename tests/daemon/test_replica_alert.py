"""The daemon alerts on DDP replicas that differ (issue 25): a 3-rank run whose streams carry the
agent's ``replica_divergence`` line (written with the stream contract, as agent/recorder.py
writes it), read by a real RunWatch, judged by the real Alerting and outbox; its
``replica_divergence`` captures are not queued for a NaN replay."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from sentineld.contracts.records import ReplicaDivergence, StepRecord, record_to_json
from sentineld.contracts.rundir import RunDir, RunMeta, make_private_dir, stream_path, write_run_meta
from sentineld.daemon.alerting import RANK_GRACE_S, Alerting
from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.loops import ReplayThread, Stats
from sentineld.daemon.metrics import DaemonMetrics
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import Outbox
from sentineld.daemon.runstate import RunState
from sentineld.daemon.runwatch import RunWatch
from tests.daemon.test_alerting import Clock

WORLD, DIV_STEP = 3, 25
DIV = ReplicaDivergence(DIV_STEP, (1,), "fc1.weight", "DDP replicas differ ...")


def write_run(runs: Path, steps: int, div_after: int | None) -> Path:
    """run.json and 3 streams; every rank writes the divergence line after step ``div_after``."""
    run_dir = make_private_dir(runs / "rep")
    t0 = time.time() - 0.01 * steps
    write_run_meta(run_dir, RunMeta(run_id="rep", started_s=time.time(), world_size=WORLD))
    for rank in range(WORLD):
        lines = [{"kind": "start", "run_id": "rep", "rank": rank, "pid": 1, "host": "h", "time_s": t0}]
        for i in range(steps):
            lines.append(record_to_json(StepRecord(step=i, loss=2.0 - 0.01 * i, grad_norm=1.0, lr=1e-3,
                                                   step_s=0.01, time_s=t0 + 0.01 * i, rank=rank)))
            if i == div_after:
                lines.append(DIV.to_json())
        stream_path(run_dir, rank).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run_dir


def alert_run(tmp_path: Path, steps: int, div_after: int | None) -> tuple[Outbox, RunState]:
    clock, outbox = Clock(), Outbox(tmp_path / "outbox")
    alerting = Alerting(DaemonConfig(runs_dir=tmp_path / "runs", state_dir=tmp_path / "state"),
                        Notifier(outbox, [], clock), Stats(), save=lambda s: None, clock=clock)
    state = RunState(RunWatch(write_run(tmp_path / "runs", steps, div_after), window=50))
    new, _caps = state.watch.poll()
    if new:
        alerting.evaluate(state)
    clock.now += RANK_GRACE_S + 0.1  # a multi-rank alert waits for the other ranks
    for st, keys in alerting.due([state]):
        alerting.release(st, keys)
    return outbox, state


def test_differing_replicas_page_once_naming_ranks_parameter_and_step(tmp_path: Path) -> None:
    outbox, state = alert_run(tmp_path, 40, div_after=27)  # the comparison lags the step
    sent = [n for n in outbox if n.kind == "alert"]
    assert [(n.signature, n.step, n.severity) for n in sent] == [("replica_divergence", DIV_STEP, "critical")]
    body = sent[0].body
    assert "rank(s) 1" in body and "'fc1.weight'" in body and f"step {DIV_STEP}" in body
    assert "silent data corruption" in body and "ECC" in body
    assert list(state.watch.active) == ["replica_divergence"]


def test_a_divergence_as_the_last_line_is_alerted(tmp_path: Path) -> None:
    outbox, _ = alert_run(tmp_path, 30, div_after=29)
    assert [(n.signature, n.step) for n in outbox if n.kind == "alert"] == [("replica_divergence", DIV_STEP)]


def test_equal_replicas_page_nothing(tmp_path: Path) -> None:
    outbox, _ = alert_run(tmp_path, 40, div_after=None)
    assert [n for n in outbox if n.kind == "alert"] == []


def test_replica_captures_are_not_replayed_as_a_nan(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "runs", 30, div_after=27)
    for rank in range(WORLD):
        RunDir(run_dir).capture(rank, DIV_STEP, "replica_divergence").write_bytes(b"x")
    RunDir(run_dir).capture(0, 20, "nonfinite").write_bytes(b"x")
    rw = RunWatch(run_dir, window=50)
    rw.poll()
    cfg = DaemonConfig(runs_dir=tmp_path / "runs", state_dir=tmp_path / "state")
    clock = Clock()
    replayer = ReplayThread(threading.Event(), cfg, tmp_path / "records", Notifier(Outbox(tmp_path / "o"), [], clock),
                            Stats(), DaemonMetrics())
    replayer.offer(rw)
    queued = []
    while replayer.jobs.qsize():
        queued.append(replayer.jobs.get(timeout=0)[1].name)
    assert queued == [RunDir.capture_name(0, 20, "nonfinite")]
