"""``make lint`` type-checks the package as installed (scripts/typecheck.py): a wrong call across
the path mapping (the agent calling the replay) fails it, where mypy over the folders as
configured sees ``Any`` and passes. The error is planted with mypy's ``--shadow-file`` (a copy
in a temp dir is read in place of the file), so the tree is never changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEAM = REPO / "agent" / "localize_live.py"
#: The agent's call into the replay engine; ``step`` is ``int | None``.
CALL = "replay_capture(path, lambda: spec.make, None,"
PLANTED = "replay_capture(path, lambda: spec.make, 'the first step',"


def test_a_wrong_call_across_the_mapping_fails_the_installed_layout_check(tmp_path):
    text = SEAM.read_text()
    assert CALL in text, "the seam this test plants an error at moved; plant it at another"
    shadow = tmp_path / "localize_live.py"
    shadow.write_text(text.replace(CALL, PLANTED))
    layout = subprocess.run([sys.executable, str(REPO / "scripts" / "typecheck.py"), "--shadow-file", str(SEAM),
                             str(shadow)], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert layout.returncode == 1, layout.stdout + layout.stderr
    assert "agent/localize_live.py:" in layout.stdout and "replay_capture" in layout.stdout, layout.stdout
    folders = subprocess.run([sys.executable, "-m", "mypy", "--shadow-file", str(SEAM), str(shadow)],
                             capture_output=True, text=True, cwd=REPO, timeout=900)
    # The folders as separate packages: sentineld.replay is Any from the agent, the error unseen.
    assert folders.returncode == 0, folders.stdout + folders.stderr
