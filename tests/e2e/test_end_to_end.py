"""End to end, all real: a training process with a planted fault, the daemon process, an SMTP
server (aiosmtpd) and an HTTP endpoint on loopback, and the replay verdict naming the module."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentineld.contracts.verdict import REPORT_SCHEMA_VERSION
from tests.conftest import REPO, wait_until

TRAIN = Path(__file__).with_name("train_digits.py")


def _train(runs_dir: Path, run_id: str, fault: str, steps: int = 60) -> None:
    subprocess.run([sys.executable, str(TRAIN), str(runs_dir), run_id, fault, str(steps)],
                   cwd=REPO, check=True, timeout=120)


def _first_nonfinite_time(run_dir: Path) -> tuple[int, float]:
    for line in (run_dir / "stream-rank0.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if obj.get("kind") == "step" and obj["loss"] != obj["loss"]:
            return obj["step"], obj["time_s"]
    raise AssertionError("no non-finite step in the stream")


@pytest.mark.slow
def test_zero_std_fault_emails_and_posts_the_culprit_module(smtp_server, http_sink, daemon_factory, tmp_path):
    smtp_port, inbox = smtp_server
    http_port, sink = http_sink
    daemon = daemon_factory(notify=[
        f"mailto://127.0.0.1:{smtp_port}?from=sentineld@localhost&to=oncall@localhost",
        f"json://127.0.0.1:{http_port}/alerts",
    ])
    _train(daemon.runs_dir, "e2e-zero-std", "zero-std")
    # Two notifications per incident: the NaN alert from the stream, then the replay verdict.
    wait_until(lambda: len(inbox.messages) >= 2, 120, "two emails (alert + verdict)")
    bodies = inbox.bodies()
    alert = next(b for b in bodies if "nonfinite" in b and "CRITICAL" in b)
    verdict = next(b for b in bodies if "replay of run e2e-zero-std" in b)
    assert "step: 0" in alert and "loss=nan" in alert
    # the first alert names the exact command, on a line of its own (issue 10)
    assert f"replay step 0: sentineld replay {daemon.runs_dir / 'e2e-zero-std'} --step 0" in alert.splitlines()
    assert "phase: forward" in verdict
    assert "module: norm (Standardize)" in verdict
    assert "op: aten.div" in verdict
    assert "reproduced: True" in verdict

    wait_until(lambda: len(sink.posts) >= 2, 30, "two JSON notifications")
    messages = [p[2] for p in sink.posts]
    assert all(isinstance(m, dict) and m.get("title") and m.get("message") for m in messages)
    assert any("module: norm (Standardize)" in m["message"] for m in messages)
    assert {p[1] for p in sink.posts} == {"/alerts"}

    # Exactly once: nothing else arrives (no alert per NaN step after the first).
    time.sleep(2.0)
    assert len(inbox.messages) == 2 and len(sink.posts) == 2

    step, t_nan = _first_nonfinite_time(daemon.runs_dir / "e2e-zero-std")
    arrival = min(t for t, _ in inbox.messages)
    # Monotonic arrival vs the agent's wall clock: convert through the current offset.
    latency = (time.time() - time.monotonic() + arrival) - t_nan
    print(f"\nNaN at step {step} -> first email after {latency:.2f} s")
    assert latency < 30

    st = wait_until(lambda: daemon.status().get("replays_run") == 1 and daemon.status(), 10, "status")
    assert st["alerts_sent"] >= 2 and st["runs_watched"] == 1
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(daemon.runs_dir / "e2e-zero-std"),
                          "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["module"] == "norm" and report["phase"] == "forward" and report["reproduced"] is True
    assert report["schema_version"] == REPORT_SCHEMA_VERSION and report["step"] == 0


@pytest.mark.slow
def test_healthy_run_raises_no_alert_and_no_capture(daemon_factory):
    daemon = daemon_factory()
    _train(daemon.runs_dir, "e2e-none", "none", steps=80)
    wait_until(lambda: daemon.status().get("runs_watched") == 1, 20, "the daemon to see the run")
    time.sleep(2.5)
    assert [n for n in daemon.notifications() if n["run"] == "e2e-none"] == []
    assert list((daemon.runs_dir / "e2e-none").glob("capture-*.h5")) == []


CRASHING = """
import sys, torch, torch.nn.functional as F
from sentineld.agent import attach
from sentineld.demo_model import load_digits_tensors, make_recipe
xtr, ytr, _, _ = load_digits_tensors()
r = make_recipe("none")
with attach(r.model, r.optimizer, run_id="crashes", runs_dir=sys.argv[1], metrics_port=0,
            recipe="sentineld.demo_model:make_recipe", snapshot_every=5) as watch:
    for step in range(12):
        x, y = xtr[step * 32:(step + 1) * 32], ytr[step * 32:(step + 1) * 32]
        if step == 9:
            x = x[:, :60]  # a shape bug: the forward raises
        r.optimizer.zero_grad()
        loss = F.cross_entropy(r.model(x), y)
        loss.backward()
        r.optimizer.step()
        watch.step(loss, batch=(x, y))
"""


@pytest.mark.slow
def test_crashed_run_gets_a_crash_alert_with_the_exception(daemon_factory):
    """Regression (new-user trial): an exception inside `with attach(...)` gave only a replay
    verdict 'every value finite', never saying the run had crashed or why."""
    daemon = daemon_factory(extra=["--no-replay"])
    out = subprocess.run([sys.executable, "-c", CRASHING, str(daemon.runs_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "RuntimeError" in out.stderr
    note = wait_until(lambda: next((n for n in daemon.notifications()
                                    if n["run"] == "crashes" and n["signature"] == "crashed"), None),
                      30, "the crash alert")
    assert note["step"] == 8 and "crashed" in note["title"]
    assert "RuntimeError" in note["body"] and "--step 8" in note["body"]
