"""The daemon's decision for a capture of a run that localizes in process (real files, real pids)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sentineld.contracts.rundir import RunMeta
from sentineld.contracts.verdict import REPORT_SCHEMA_VERSION
from sentineld.contracts.verdict_file import verdict_path, write_verdict
from sentineld.daemon.inprocess import InProcessVerdicts

REPORT = {"schema_version": REPORT_SCHEMA_VERSION, "run_id": "r", "rank": 0, "phase": "forward",
          "module": "feats", "reproduced": True, "step": 3, "elapsed_s": 0.4,
          "capture": "/anywhere/capture-rank0-step000000003-nonfinite.h5"}


def _cap(tmp_path: Path, step: int = 3) -> Path:
    """A capture file (its owner is checked against the verdict's: verdict_accept)."""
    cap = tmp_path / f"capture-rank0-step{step:09d}-nonfinite.h5"
    cap.write_bytes(b"")
    return cap


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _meta(localize: str | None = "thread", pid: int | None = None, recipe: str | None = None) -> RunMeta:
    extra = {} if localize is None else {"localize": localize}
    return RunMeta(run_id="r", recipe=recipe, pid=os.getpid() if pid is None else pid, extra=extra)


def test_runs_without_in_process_localization_are_replayed_by_the_daemon(tmp_path: Path) -> None:
    v = InProcessVerdicts(60)
    cap = tmp_path / "capture-rank0-step000000003-nonfinite.h5"
    assert v.decide(_meta(None), cap) == ("spawn", None)
    assert v.decide(_meta("off"), cap) == ("spawn", None)
    # a manual capture is a checkpoint: the training process does not localize it
    assert v.decide(_meta(), tmp_path / "capture-rank0-step000000003-manual.h5") == ("spawn", None)


def test_waits_for_the_live_process_then_delivers_its_report(tmp_path: Path) -> None:
    clock = Clock()
    v = InProcessVerdicts(60, clock=clock)
    cap = _cap(tmp_path)
    assert v.decide(_meta(), cap) == ("wait", None)
    clock.t += 30
    assert v.decide(_meta(), cap) == ("wait", None)
    path = write_verdict(cap, json.dumps(REPORT))
    assert path == verdict_path(cap) and path.name == "capture-rank0-step000000003-nonfinite.verdict.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    decision, outcome = v.decide(_meta(), cap)
    assert decision == "deliver" and outcome.result == "localized" and outcome.report == REPORT


def test_a_failed_or_missing_verdict_falls_back_to_the_recipe_or_says_why(tmp_path: Path) -> None:
    clock = Clock()
    v = InProcessVerdicts(60, clock=clock)
    cap = _cap(tmp_path)
    write_verdict(cap, {"result": "failed", "reason": "TypeError: boom"})
    assert v.decide(_meta(recipe="m:f"), cap) == ("spawn", None)
    decision, outcome = v.decide(_meta(), cap)
    assert decision == "deliver" and outcome.result == "failed"
    assert "TypeError: boom" in outcome.reason and "recipe=" in outcome.reason

    cap2 = _cap(tmp_path, 9)
    decision, outcome = v.decide(_meta(pid=_dead_pid()), cap2)  # the process ended without a verdict
    assert decision == "deliver" and "ended without writing its verdict" in outcome.reason
    cap3 = _cap(tmp_path, 11)
    assert v.decide(_meta(), cap3) == ("wait", None)
    clock.t += 61
    decision, outcome = v.decide(_meta(), cap3)
    assert decision == "deliver" and "no verdict within 60 s" in outcome.reason


def test_a_report_that_did_not_reproduce_is_delivered_as_such(tmp_path: Path) -> None:
    cap = _cap(tmp_path)
    write_verdict(cap, json.dumps({**REPORT, "reproduced": False}))
    assert InProcessVerdicts(60).decide(_meta(), cap)[1].result == "not_reproduced"
    verdict_path(cap).write_text("{not json")
    decision, outcome = InProcessVerdicts(60).decide(_meta(), cap)
    assert decision == "deliver" and "not JSON" in outcome.reason


def test_a_verdict_file_that_is_a_symlink_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    # Read like every run-dir file (contracts.safeio): a link to a report elsewhere is not the
    # training process's verdict, and a FIFO in its place must not block the replay thread.
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(REPORT))
    cap = _cap(tmp_path)
    verdict_path(cap).symlink_to(elsewhere)
    decision, outcome = InProcessVerdicts(60).decide(_meta(), cap)
    assert decision == "deliver" and outcome.result == "failed" and "symbolic link" in outcome.reason
    assert InProcessVerdicts(60).decide(_meta(recipe="m:f"), cap) == ("spawn", None)

    cap2 = _cap(tmp_path, 5)
    os.mkfifo(verdict_path(cap2))
    decision, outcome = InProcessVerdicts(60).decide(_meta(), cap2)
    assert decision == "deliver" and "FIFO" in outcome.reason
