"""``make demo``'s first lines: the demo's output and the command it runs, no bare recipe line.

Before, ``make demo`` printed ``scripts/setup.sh`` (make echoing the set-up recipe) above the demo
even when .venv was already up to date. The real Makefile runs here under the real make, in a
copy of the repository's layout whose scripts/setup.sh and .venv/bin/sentineld are stand-ins
(the real set-up installs packages; the real demo trains for half a minute).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_prints_no_bare_setup_line(tmp_path: Path) -> None:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    _stub(tmp_path / "scripts" / "setup.sh", ": up to date, as on every run after the first")
    _stub(tmp_path / ".venv" / "bin" / "sentineld", 'echo "demo ran with: $*"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    out = subprocess.run(["make", "--no-print-directory", "demo", "FAULT=lr"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == [".venv/bin/sentineld demo --fault lr", "demo ran with: demo --fault lr"]
    assert out.stderr == ""
