"""A second local user (``sntl_mallory``, a real Unix account) against ``sentineld start`` run from a
folder others may write (``cd /tmp && sentineld start``).

Before: the background start ran the daemon as ``python -m sentineld start --foreground`` in the
caller's working directory, and ``-m`` puts that directory first on ``sys.path``: her
``/tmp/sentineld/__init__.py`` was imported instead of ours and ran as root, as the daemon.
``sentineld demo`` started its daemon the same way. Now both start it through
:func:`sentineld.contracts.trust.module_command` (the working directory is not on the path).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.reliability.test_trust_users import (  # noqa: F401 - fixtures
    as_mallory, mallory, plant_package, public_dir, shared)

pytestmark = [pytest.mark.slow,  # a real daemon
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]


def test_start_from_a_folder_she_can_write_never_imports_her_package(mallory, shared, tmp_path):  # noqa: F811
    pub = public_dir(shared)
    marker = shared / "ran"
    plant_package(mallory, pub, marker)
    sentineld = [sys.executable, "-c", "import sys; del sys.path[0]; from sentineld.cli import main; main()"]
    state = tmp_path / "state"
    try:
        r = subprocess.run([*sentineld, "start", "--state-dir", str(state), "--runs-dir", str(tmp_path / "runs"),
                            "--metrics-port", "0"], cwd=pub, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "sentineld daemon started" in r.stdout
        assert not marker.exists()
    finally:
        subprocess.run([*sentineld, "stop", "--state-dir", str(state)], capture_output=True, timeout=60)
