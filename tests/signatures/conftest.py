"""The healthy corpus, recorded once per session: ``test_healthy_corpus.py`` and
``test_spike_corpus_reads.py`` read the same runs (recording them is ~40 s of real training on the
shared 2-core machine; each module recorded them itself before, issue 23)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sentineld.contracts.records import StepRecord
from tests.shared_once import shared_once
from tests.signatures.corpus import FAULT_RUNS, HEALTHY_RUNS, read_records, record


@pytest.fixture(scope="session")
def _corpus_run_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    """Every healthy and fault run trained once under the agent (once per test run, also across
    xdist workers): ``name -> (run dir, seconds)``."""
    def build(runs_dir: Path) -> dict[str, tuple[str, float]]:
        out = {}
        for run in HEALTHY_RUNS + FAULT_RUNS:
            t = time.perf_counter()
            out[run.name] = (str(record(run, runs_dir)), time.perf_counter() - t)
        return out
    return {name: (Path(d), s) for name, (d, s) in shared_once(tmp_path_factory, "corpus", build).items()}


@pytest.fixture(scope="module")
def recorded(_corpus_run_dirs: dict[str, tuple[Path, float]]) -> dict[str, tuple[list[StepRecord], float]]:
    """``name -> (records, seconds its recording took)``, read back from its stream for each
    module: a module gets records of its own, so none sees another's changes to them."""
    return {name: (read_records(run_dir), s) for name, (run_dir, s) in _corpus_run_dirs.items()}
