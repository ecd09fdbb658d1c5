"""End to end, all real: a plain loop with ``attach(..., loss_fn=)`` (and one with neither loss_fn nor
recipe) and a planted forward NaN, a real daemon, a real SMTP server: the verdict the training
process wrote is the one delivered (the daemon spawns no replay of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from sentineld.contracts.verdict_file import verdict_path
from sentineld.contracts.rundir import list_captures
from tests.conftest import REPO, wait_until
from tests.replay.livecases import FAULT_STEP


@pytest.mark.slow
@pytest.mark.parametrize("fault, checked", [("forward", "full"), ("forward_only", "forward only")])
def test_in_process_verdict_is_delivered_by_the_daemon(smtp_server, daemon_factory, fault, checked):
    smtp_port, inbox = smtp_server
    daemon = daemon_factory(notify=[f"mailto://127.0.0.1:{smtp_port}?from=sentineld@localhost&to=oncall@localhost"])
    run_id = f"e2e-live-{fault.replace('_', '-')}"
    out = subprocess.run([sys.executable, "-m", "tests.replay.livecases", str(daemon.runs_dir), run_id, fault, "30"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    summary = json.loads(out.stdout.splitlines()[-1])
    run_dir = daemon.runs_dir / run_id
    cap = next(c[3] for c in list_captures(run_dir) if c[2] == "nonfinite")
    vfile = verdict_path(cap)
    assert vfile.exists()

    wait_until(lambda: any("replay of run" in b for b in inbox.bodies()), 60, "the verdict email")
    verdict = next(b for b in inbox.bodies() if "replay of run" in b)
    assert f"step: {FAULT_STEP}" in verdict
    assert "phase: forward" in verdict and "module: feats (LogFeatures)" in verdict
    assert "op: aten.log" in verdict and "reproduced: True" in verdict
    if fault == "forward_only":
        assert "not checked: loss, backward, optimizer step" in verdict and "loss_fn=" in verdict
    else:
        assert "not checked" not in verdict
    # Delivered from the run's own file: the daemon's replay record holds that very report,
    # and no replay subprocess ran (its elapsed time is the in-process one).
    records = [json.loads(p.read_text()) for p in (daemon.state_dir / "replays").glob("*.json")]
    assert len(records) == 1 and records[0]["result"] == "localized"
    assert records[0]["report"] == json.loads(vfile.read_text())

    arrival = min(t for t, m in inbox.messages if "replay of run" in str(m["subject"]))
    delivered = time.time() - time.monotonic() + arrival
    t_nan = summary["nan_time_s"]
    print(f"\n{checked}: NaN at step {FAULT_STEP} -> verdict file {vfile.stat().st_mtime - t_nan:.2f} s, "
          f"-> verdict email {delivered - t_nan:.2f} s; second copy {summary['memory_bytes']} bytes")
    assert delivered - t_nan < 30
