"""README's sample of ``sentineld demo`` is what the demo prints (issue 10: it had drifted).

Runs the real demo (real training, a real daemon, the real replay) with stdout piped, so this is
also the output off a terminal, never wrapped at 80 columns. Run ids, temp dirs, host, pids and
the read-timing-dependent step counts are normalized on both sides.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # the real demo: training, a daemon and a replay (~20 s)

MARKER = "<!-- sentineld demo output: kept true by tests/e2e/test_demo_readme.py -->"

_NORMALIZE = [
    (re.compile(r"demo-(zero-std|lr|none)-\d{8}-\d{6}-\d+"), r"demo-\1-RUN"),
    (re.compile(r"/\S*?sentineld-demo-runs-[^/\s]+"), "/tmp/sentineld-demo-runs-X"),
    (re.compile(r"/\S*?sentineld-demo-state-[^/\s]+"), "/tmp/sentineld-demo-state-X"),
    (re.compile(r"host: \S+"), "host: H"),
    (re.compile(r"\(pid \d+\)"), "(pid P)"),
    (re.compile(r"\S*/bin/sentineld "), ".venv/bin/sentineld "),
    (re.compile(r"test accuracy \d\.\d+"), "test accuracy A"),
    # how many steps the daemon saw depends on when it read the stream
    (re.compile(r"\(\d+ of the last \d+ steps non-finite\)"), "(K of the last W steps non-finite)"),
    (re.compile(r"nonfinite_steps=\d+"), "nonfinite_steps=K"),
]


def normalize(text: str) -> list[str]:
    """``text`` from the line ``training stopped ...`` on (the progress bar before it is live),
    with the run-specific parts replaced."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("training stopped after")), 0)
    out = []
    for ln in lines[start:]:
        for rx, sub in _NORMALIZE:
            ln = rx.sub(sub, ln)
        out.append(ln)
    return out


def readme_sample() -> str:
    readme = (REPO / "README.md").read_text()
    assert MARKER in readme, "README.md lost the demo sample's marker"
    block = readme.split(MARKER, 1)[1].split("```", 2)
    return block[1].lstrip("\n")


def test_readme_demo_sample_is_the_real_output(tmp_path: Path) -> None:
    env = {**os.environ, "SENTINELD_STATE_DIR": str(tmp_path / "no-daemon-here"), "OMP_NUM_THREADS": "1"}
    runs = tmp_path / "sentineld-demo-runs-test"
    out = subprocess.run([sys.executable, "-m", "sentineld", "demo", "--runs-dir", str(runs), "--timeout", "150"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    real = normalize(out.stdout)
    assert real and real[0].startswith("training stopped after"), out.stdout
    # nothing wrapped: the printed replay commands are whole lines
    assert any(ln.startswith("replay step 0: sentineld replay /tmp/sentineld-demo-runs-X/demo-zero-std-RUN --step 0")
               for ln in real), "\n".join(real)
    want = normalize(readme_sample())
    assert want == real, ("README's demo sample differs from the real output; the real one, normalized:\n"
                          + "\n".join(real))
