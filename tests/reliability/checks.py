"""Assertions shared by the reliability tests: a capture on disk is complete, a stream is readable."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sentineld.contracts.capture import open_capture
from sentineld.contracts.stream import read_stream


def check_capture(path: Path) -> dict[str, Any]:
    """Open ``path`` and read every part of it; return a summary. Fails the test if incomplete."""
    with open_capture(path) as cap:
        steps = cap.steps
        assert steps, f"{path.name}: no steps"
        assert steps == list(range(steps[0], steps[-1] + 1)), f"{path.name}: steps not contiguous {steps}"
        assert steps[0] == cap.snapshot_step, f"{path.name}: first step {steps[0]} != snapshot {cap.snapshot_step}"
        assert cap.first_step in steps, f"{path.name}: trigger step {cap.first_step} missing"
        snap = cap.snapshot()
        assert snap["model"], f"{path.name}: empty model state"
        for s in steps:
            st = cap.step(s)
            assert st.batch is not None
        records = cap.records()
        assert isinstance(records, list)
        return {"trigger": cap.trigger, "first_step": cap.first_step, "snapshot_step": cap.snapshot_step,
                "steps": steps, "records": len(records), "message": cap.message}


def check_stream(path: Path) -> list[dict[str, Any]]:
    """Every complete line parses; step records run 0..k without gap or repeat. Returns them."""
    objs, _offset, bad = read_stream(path)
    assert bad == 0, f"{path}: {bad} unreadable lines"
    steps = [o for o in objs if o.get("kind") == "step"]
    assert [o["step"] for o in steps] == list(range(len(steps))), f"{path}: steps not 0..{len(steps) - 1}"
    return steps


def first_nonfinite(steps: list[dict[str, Any]]) -> int | None:
    for o in steps:
        if not math.isfinite(o["loss"]) or (o.get("grad_norm") is not None and not math.isfinite(o["grad_norm"])):
            return int(o["step"])
    return None


def write_run(runs_dir: Path, run_id: str, steps: int, nan_at: set[int] | frozenset[int] = frozenset(),
              end: bool = True, start_time_s: float | None = None, **meta: Any) -> Path:
    """A run directory as the agent writes it (run.json, a JSON-lines stream through the real
    StreamWriter), without a training process: healthy-looking records, NaN loss at ``nan_at``."""
    import os
    import socket
    import time

    from sentineld.contracts.records import StepRecord, record_to_json
    from sentineld.contracts.rundir import RunMeta, make_private_dir, stream_path, write_run_meta
    from sentineld.contracts.stream import StreamWriter

    run_dir = make_private_dir(runs_dir / run_id)
    write_run_meta(run_dir, RunMeta(run_id=run_id, started_s=time.time(), **meta))
    w = StreamWriter(stream_path(run_dir, 0), flush_s=0.05)
    t = time.time() if start_time_s is None else start_time_s
    w.put({"kind": "start", "run_id": run_id, "rank": 0, "pid": os.getpid(), "host": socket.gethostname(),
           "time_s": t})
    for i in range(steps):
        loss = float("nan") if i in nan_at else 2.0 * 0.995 ** i + 0.01 * ((i * 7919) % 13)
        w.put(record_to_json(StepRecord(step=i, loss=loss, grad_norm=1.0 + 0.01 * (i % 5), lr=1e-3,
                                        step_s=0.01, time_s=t + 0.01 * i)))
    if end:
        w.put({"kind": "end", "reason": "finished", "steps": steps, "time_s": t + 0.01 * steps})
    w.close()
    return run_dir
