"""The healthy-run corpus (issue 21): 0 notifications on every healthy run, and the planted
faults on the same recipes still alert.

Every run is real torch training recorded through the real agent into its run directory
(:mod:`tests.signatures.corpus`, :mod:`tests.signatures.corpus_frameworks`); its stream is read
back as the daemon reads it, and the daemon's chain (signatures, unresolved, policy:
:mod:`tests.signatures.chain`) runs over it once per record. Each run is recorded once per
session (tests/signatures/conftest.py, shared with test_spike_corpus_reads.py). A notification is
an alert or a RESOLVED notice.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentineld.contracts.records import StepRecord
from tests.conftest import REPO
from tests.signatures.chain import notifications
from tests.signatures.corpus import FAULT_RUNS, HEALTHY_RUNS, Run, read_records
from tests.signatures.corpus_frameworks import RUNS as FRAMEWORK_RUNS

#: steps from the planted fault to its alert, at most (the signatures' stated latencies:
#: tests/signatures/scenarios.py; plateau is judged after its 100-step patience)
LATENCY = {"vanishing_gradients": 10, "exploding_gradients": 4, "plateau": 100, "update_ratio": 15,
           "nonfinite": 0, "divergence_spike": 3}


@pytest.mark.parametrize("run", HEALTHY_RUNS, ids=[r.name for r in HEALTHY_RUNS])
def test_healthy_run_notifies_nothing(recorded: dict, run: Run) -> None:
    records, _ = recorded[run.name]
    assert len(records) == run.steps
    notes = notifications(records, run.num_classes)
    assert notes == [], f"{run.name} ({run.kind}): {notes}"


@pytest.mark.parametrize("run", FAULT_RUNS, ids=[r.name for r in FAULT_RUNS])
def test_planted_fault_on_the_same_recipe_still_alerts(recorded: dict, run: Run) -> None:
    records, _ = recorded[run.name]
    notes = notifications(records, run.num_classes, ended=False)
    alerts = {key.partition("@")[0]: step for kind, key, step in reversed(notes) if kind == "alert"}
    assert run.expect in alerts, f"{run.name} ({run.kind}): only {alerts}"
    fault_step = _fault_step(run)
    assert fault_step <= alerts[run.expect] <= fault_step + LATENCY[run.expect], alerts
    if not run.resolves:  # the fault lasts to the end: so does its alert (49179bb resolved some)
        assert ("resolved", run.expect) not in [(k, key) for k, key, _ in notes], notes


def _fault_step(run: Run) -> int:
    """The step the planted fault starts: the first step its records differ from the healthy
    recipe's would need a second run; each fault's step is in its ``kind`` instead."""
    words = run.kind.replace(",", " ").split()
    for i, w in enumerate(words):
        if w == "step" and i + 1 < len(words) and words[i + 1].isdigit():
            return int(words[i + 1])
    return 0


def test_the_corpus_is_large_and_varied() -> None:
    assert len(HEALTHY_RUNS) + len(FRAMEWORK_RUNS) >= 30
    assert len({r.kind for r in HEALTHY_RUNS}) == len(HEALTHY_RUNS)


@pytest.mark.slow
def test_framework_runs_notify_nothing(tmp_path: Path) -> None:
    """Lightning (plain, and clipping at 1.0) and the HF Trainer (a tiny BERT classifier, a tiny
    GPT-2 LM; max_grad_norm 1.0 by default), models built from configs: 0 notifications."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("corpus_frameworks.py")), str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={"PYTHONWARNINGS": "ignore", **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {}
    for name, num_classes in FRAMEWORK_RUNS.items():
        records = read_records(tmp_path / name)
        assert len(records) >= 100, name
        seen[name] = notifications(records, num_classes)
    assert seen == {name: [] for name in FRAMEWORK_RUNS}, f"{seen} ({time.perf_counter() - t:.0f} s)"
