"""Running the framework training scripts and the replay CLI as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
LIT_TRAIN = HERE / "lit_train.py"
HF_TRAIN = HERE / "hf_train.py"

#: No hub download, ever: the models are built from configs.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def train(script: Path, runs_dir: Path, *specs: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``script RUNS_DIR SPEC...`` from the repository root; fail with its output if it fails."""
    out = subprocess.run([sys.executable, str(script), str(runs_dir), *specs], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def replay(run_dir: Path, *extra: str, cwd: Path = REPO) -> tuple[int, dict[str, Any] | None, str]:
    """``sentineld replay RUN --json``: (exit code, the report or None, stderr)."""
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run_dir), "--json", *extra],
                         cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout) if out.returncode in (0, 1) and out.stdout.strip() else None
    return out.returncode, report, out.stderr


def stream(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "stream-rank0.jsonl").read_text().splitlines() if x.strip()]


def first_nonfinite_step(run_dir: Path) -> int:
    for obj in stream(run_dir):
        if obj.get("kind") == "step" and (obj["loss"] != obj["loss"] or obj["loss"] in (float("inf"), float("-inf"))
                                          or obj.get("grad_norm") != obj.get("grad_norm")):
            return int(obj["step"])
    raise AssertionError(f"no non-finite step in {run_dir}")


def verdict(report: dict[str, Any]) -> tuple[Any, ...]:
    return (report["step"], report["phase"], report["module"], report["module_type"], report["op"],
            report["reproduced"])
