"""What ``sentineld replay`` prints (issue 10, Messages), on real zoo runs replayed by the real CLI
with stdout piped: a tensor's -inf is counted (on d9bb298 the text showed the finite range and
``1 non-finite``, hiding which kind), and a step with gradient accumulation names its micro-batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.replay.conftest import train_zoo


def _replay(run_dir: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run_dir)], capture_output=True,
                         text=True, timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.slow  # two zoo runs trained, then two real `sentineld replay` processes (~15-30 s)
def test_replay_text_counts_neginf_and_names_the_micro_batch(tmp_path: Path) -> None:
    runs = tmp_path / "zoo"
    train_zoo(runs, ["sigmoid_log", "accum_nan"])
    lines = _replay(runs / "sigmoid_log")
    assert lines[0].startswith("[sentineld] replay of run sigmoid_log: step "), lines
    assert "went non-finite in forward" in lines[0]
    assert "op: aten.log" in lines
    output = next(ln for ln in lines if ln.startswith("op output: "))
    counts = re.search(r"NaN (\d+), \+Inf (\d+), -Inf (\d+)", output)
    assert counts is not None, output
    nan, posinf, neginf = (int(x) for x in counts.groups())
    assert neginf >= 1 and nan == 0 and posinf == 0, output  # log(0) = -inf, nothing else
    assert any(ln.startswith(f"replay it: sentineld replay {runs / 'sigmoid_log'} --step ") for ln in lines)

    lines = _replay(runs / "accum_nan")
    assert "phase: data" in lines
    assert "micro-batch: 2 of 3 (gradient accumulation)" in lines, "\n".join(lines)
    field = next(ln for ln in lines if ln.startswith("field: batch[1][0]"))
    assert "NaN 0, +Inf 1, -Inf 0" in field, field
