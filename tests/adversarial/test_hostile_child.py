"""A second local user (``sntl_mallory``, a real Unix account) against the agent's localization
child, when training runs from a folder others may write (``cd /tmp && python ~/proj/train.py``).

Before: the child was started as ``python -m sentineld.replay.live_child`` in training's working
directory, and ``-m`` puts that directory first on ``sys.path``: her ``/tmp/sentineld/__init__.py``
ran as the training user (root here) at the first NaN. Training itself never imports from there
(``python script.py`` puts the script's folder on the path, not the working directory). Now the
child gets training's own ``sys.path`` and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.regress import lossfn_project as lp
from tests.reliability.test_trust_users import (  # noqa: F401 - fixtures
    as_mallory, mallory, plant_package, public_dir, shared)

pytestmark = [pytest.mark.slow,  # real training with its localization child
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]


def test_the_localization_child_never_imports_from_the_working_directory(mallory, shared, tmp_path):  # noqa: F811
    project = lp.write_project(tmp_path / "project")
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    pub = public_dir(shared)
    marker = shared / "ran"
    plant_package(mallory, pub, marker)
    r = subprocess.run([sys.executable, str(project / "train.py"), str(runs), "cwd"], cwd=pub, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "CLOSE_WAIT_S": "60"})
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    verdict = json.loads(next((runs / "cwd").glob("capture-*.verdict.json")).read_text())
    assert verdict.get("result") != "failed", verdict  # the child still localized, from training's own path
    assert verdict["phase"] == "forward" and verdict["run_id"] == "cwd"
