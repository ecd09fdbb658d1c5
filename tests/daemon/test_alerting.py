"""The daemon's alerting as a collaborator (sentineld.daemon.alerting), driven without a Daemon:
real run directories read by a real RunWatch, a real outbox, a clock the test moves."""

from __future__ import annotations

import json
import time
from pathlib import Path

from sentineld.contracts.records import StepRecord, record_to_json
from sentineld.contracts.rundir import RunMeta, make_private_dir, stream_path, write_run_meta
from sentineld.daemon.alerting import RANK_GRACE_S, Alerting
from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.loops import Stats
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import Outbox
from sentineld.daemon.runstate import RunState
from sentineld.daemon.runwatch import RunWatch
from sentineld.daemon.service import Daemon


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def write_run(runs: Path, run_id: str, steps: int, nan_at: set[int], world_size: int = 1,
              started_s: float | None = None) -> Path:
    """run.json and one stream per rank as the agent writes them; NaN loss at ``nan_at``."""
    run_dir = make_private_dir(runs / run_id)
    t0 = time.time() - 0.01 * steps
    write_run_meta(run_dir, RunMeta(run_id=run_id, started_s=started_s or time.time(), world_size=world_size))
    for rank in range(world_size):
        lines = [{"kind": "start", "run_id": run_id, "rank": rank, "pid": 1, "host": "h", "time_s": t0}]
        lines += [record_to_json(StepRecord(step=i, loss=float("nan") if i in nan_at else 2.0 - 0.01 * i,
                                            grad_norm=1.0, lr=1e-3, step_s=0.01, time_s=t0 + 0.01 * i))
                  for i in range(steps)]
        stream_path(run_dir, rank).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run_dir


def make(tmp_path: Path) -> tuple[Alerting, Outbox, Clock, list[RunState]]:
    clock, outbox, saved = Clock(), Outbox(tmp_path / "outbox"), []
    notifier = Notifier(outbox, [], clock)
    alerting = Alerting(DaemonConfig(runs_dir=tmp_path / "runs", state_dir=tmp_path / "state"), notifier,
                        Stats(), save=saved.append, clock=clock)
    return alerting, outbox, clock, saved


def read(run_dir: Path) -> RunState:
    state = RunState(RunWatch(run_dir, window=50))
    state.watch.poll()
    return state


def alerts(outbox: Outbox) -> list[tuple[str | None, int | None]]:
    return sorted((n.signature, n.step) for n in outbox if n.kind == "alert")


def test_a_nan_is_alerted_once_and_saved_after_its_outbox_entry(tmp_path):
    alerting, outbox, _clock, saved = make(tmp_path)
    state = read(write_run(tmp_path / "runs", "r1", 12, {9}))
    alerting.evaluate(state)
    assert alerts(outbox) == [("nonfinite", 9)]
    assert state.watch.active["nonfinite"]["notified"] is True
    assert saved and saved[-1] is state  # the progress that says it was sent, after the outbox
    alerting.evaluate(state)  # the same window again: nothing new
    assert alerts(outbox) == [("nonfinite", 9)]
    assert state.last_eval_s == _clock.now


def test_a_multi_rank_alert_is_held_for_the_other_ranks_then_released(tmp_path):
    alerting, outbox, clock, _saved = make(tmp_path)
    state = read(write_run(tmp_path / "runs", "r2", 12, {9}, world_size=2))
    alerting.evaluate(state)
    assert alerts(outbox) == [] and list(state.held) == ["nonfinite"]
    assert alerting.due([state]) == []  # the grace is not over
    clock.now += RANK_GRACE_S
    due = alerting.due([state])
    assert due == [(state, ["nonfinite"])] and state.held == {}
    alerting.release(state, due[0][1])
    assert alerts(outbox) == [("nonfinite", 9)]
    assert state.watch.active["nonfinite"]["ranks"] == [0, 1]


def test_idle_evaluation_waits_for_idle_eval_s(tmp_path):
    alerting, _outbox, clock, _saved = make(tmp_path)
    state = read(write_run(tmp_path / "runs", "r3", 5, set()))
    alerting.evaluate_idle([state])
    first = state.last_eval_s
    clock.now += 1.0
    alerting.evaluate_idle([state])
    assert state.last_eval_s == first  # evaluated moments ago: not again


def test_a_replaced_run_leaves_nothing_of_the_old_one(tmp_path):
    """Regression: on 49179bb forgetting a run cleared four of the daemon's six per-run tables;
    ``_last_eval`` and ``_run_failures`` kept the old run's entries."""
    runs = tmp_path / "runs"
    d = Daemon(DaemonConfig(runs_dir=runs, state_dir=tmp_path / "state", replay=False, metrics_port=0))
    run_dir = write_run(runs, "r4", 12, {9}, started_s=1.0)
    d._process(run_dir)
    old = d.runs[str(run_dir)]
    old.failure = "OSError: the old run's failure"
    assert old.last_eval_s > 0 and old.watch.active
    for p in run_dir.iterdir():
        p.unlink()
    write_run(runs, "r4", 3, set(), started_s=2.0)  # a new run took the path
    d._process(run_dir)
    new = d.runs[str(run_dir)]
    assert new is not old and new.failure is None and not new.watch.active
    d._forget(run_dir)
    leftovers = [name for name, v in vars(d).items() if isinstance(v, (dict, set)) and
                 any(str(run_dir) in str(k) for k in v)]
    assert leftovers == []
