"""Rebuild keeps the run's numerics (threads, deterministic flags, dtypes) and leaves the calling
process as it found it."""

from __future__ import annotations

from pathlib import Path

import torch

from sentineld.replay import replay_run

from .conftest import edit_run_json


def test_recorded_torch_flags_are_applied_and_restored(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    edit_run_json(run, num_threads=1, extra={"torch_flags": {"deterministic_algorithms": True,
                                                             "float32_matmul_precision": "high"}})
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.get_float32_matmul_precision(), torch.get_rng_state())
    r = replay_run(run, 5)
    flags = r.evidence["torch_flags"]
    assert flags["deterministic_algorithms"] is True and flags["float32_matmul_precision"] == "high"
    assert flags["num_threads"] == 1
    assert r.reproduced and r.phase == "none"
    after = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision(), torch.get_rng_state())
    assert after[:3] == before[:3] and torch.equal(after[3], before[3])


def test_report_times_and_rebuilt_losses(mini_run: tuple[Path, Path]) -> None:
    run, _ = mini_run
    r = replay_run(run, 5)
    assert r.rebuild_s > 0 and r.localize_s > 0 and r.elapsed_s >= r.rebuild_s + r.localize_s
    assert list(r.evidence["rebuilt_losses"]) == ["4", "5"] and r.evidence["snapshot_step"] == 4
