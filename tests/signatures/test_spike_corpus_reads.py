"""The healthy corpus read the way a daemon reads a fast run or a backlog (issue 21): reads of 1,
8, 30 or 100 records into a 200-record window, each evaluated once with ``new`` = its size. The
rules that now judge every new record (``loss_spike``, ``divergence_spike``) stay silent on all
healthy runs, and the planted divergence still fires within its latency.

(``tests/signatures/test_healthy_corpus.py`` evaluates one record per read; this is the other
extreme. Both read the corpus recorded once per session: tests/signatures/conftest.py.)
"""

from __future__ import annotations

import random

import pytest

from sentineld.contracts.records import StepRecord
from sentineld.signatures import SignatureConfig, evaluate
from tests.signatures.corpus import FAULT_RUNS, HEALTHY_RUNS

RULES = ("loss_spike", "divergence_spike")


def _read_in_slices(records: list[StepRecord], num_classes: int | None, seed: int) -> set[tuple[str, int]]:
    rnd, cfg, out, end = random.Random(seed), SignatureConfig(), set(), 0
    while end < len(records):
        k = rnd.choice([1, 8, 30, 100])
        end = min(len(records), end + k)
        out |= {(v.signature, v.step) for v in evaluate(records[max(0, end - 200):end], cfg,
                                                         num_classes=num_classes, new=k)
                if v.signature in RULES}
    return out


@pytest.mark.slow
def test_healthy_runs_stay_silent_in_any_read_size(recorded: dict) -> None:
    fired = {run.name: got for run in HEALTHY_RUNS for seed in (0, 1)
             if (got := _read_in_slices(recorded[run.name][0], run.num_classes, seed))}
    assert fired == {}


@pytest.mark.slow
def test_planted_divergence_fires_in_any_read_size(recorded: dict) -> None:
    """Labels off by one from step 100 (the corpus plants it there): alerted at 100-103."""
    run = next(r for r in FAULT_RUNS if r.expect == "divergence_spike")
    for seed in (0, 1):
        got = _read_in_slices(recorded[run.name][0], run.num_classes, seed)
        steps = sorted(s for sig, s in got if sig == "divergence_spike")
        assert steps and 100 <= steps[0] <= 103, (seed, steps)
