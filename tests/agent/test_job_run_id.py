"""Run ids of torchrun (elastic) jobs: from the job, and a new run per restart attempt."""

from __future__ import annotations

import pytest

from sentineld.agent.runinfo import default_run_id, job_attempt


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("SENTINELD_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR",
                "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_run_id_is_the_jobs_rendezvous_id(env: pytest.MonkeyPatch) -> None:
    env.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert default_run_id() == "job42"
    env.setenv("SENTINELD_RUN_ID", "mine")
    assert default_run_id() == "mine"


def test_torchruns_placeholder_id_becomes_the_jobs_master_address(env: pytest.MonkeyPatch) -> None:
    # torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none for every job: not a name.
    env.setenv("TORCHELASTIC_RUN_ID", "none")
    env.setenv("MASTER_ADDR", "10.0.0.7")
    env.setenv("MASTER_PORT", "29500")
    assert default_run_id() == "torchrun-10.0.0.7-29500"


def test_restart_attempt_is_a_new_run(env: pytest.MonkeyPatch) -> None:
    assert job_attempt("job42") == "job42"
    env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert job_attempt("job42") == "job42"
    env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert job_attempt("job42") == "job42-attempt2"
    assert job_attempt("x" * 128) == "x" * 119 + "-attempt2"  # still a valid (<= 128) run id
    env.setenv("TORCHELASTIC_RESTART_COUNT", "garbage")
    assert job_attempt("job42") == "job42"
