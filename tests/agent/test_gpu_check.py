"""bench/gpu_check.py runs its own logic here: without CUDA it says so and exits 0; ``--device
cpu`` goes through all three parts (sync check, overhead, capture + replay) and passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message is for machines without one")
def test_without_cuda_it_says_so_and_exits_0():
    p = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "no CUDA device" in p.stdout


def test_cpu_dry_run_passes_every_part():
    p = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--width", "64", "--steps", "30",
                        "--blocks", "2", "--block", "3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    lines = {ln.split(":", 1)[0]: ln for ln in p.stdout.splitlines()}
    assert '"agent_enabled_after_error_mode": true' in lines["sync"]
    assert '"steps_recorded": 31' in lines["sync"]
    assert '"step": 30' in lines["capture_replay"] and '"reproduced": true' in lines["capture_replay"]
    assert p.stdout.rstrip().endswith("PASS on cpu")
