"""A second local user (``sntl_mallory``, a real Unix account) against ``sentineld preflight
--lr-range`` whose plot goes to a folder others may write (``--lr-plot /tmp/lr.png``; the default
``./preflight-lr-range.png`` is as predictable).

Before: matplotlib's ``savefig(path)`` wrote the PNG through her ``lr.png`` link, over a root file
of her choice. Now the plot is rendered in memory and written by the safe writer: her link is
refused (the check says the plot was not written and still reports the sweep), nothing is written
through it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.preflight.test_cli import MODULE, SENTINELD
from tests.reliability.test_trust_users import (  # noqa: F401 - fixtures
    as_mallory, mallory, precious_file, public_dir, shared)

pytestmark = [pytest.mark.slow,  # a real LR sweep in a subprocess
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]

PRECIOUS = b"root's own file: never to be overwritten\n"


def test_the_lr_plot_never_goes_through_her_link(mallory, shared, tmp_path):  # noqa: F811
    tmp_path.chmod(0o700)
    (tmp_path / "pftrain.py").write_text(MODULE)
    pub = public_dir(shared)
    precious = precious_file(shared, PRECIOUS)
    as_mallory(mallory, f"ln -s {precious} {pub}/lr.png")
    r = subprocess.run([str(SENTINELD), "preflight", "pftrain:make_recipe", "--data", "pftrain:data", "--json",
                        "--lr-range", "--lr-plot", str(pub / "lr.png")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert precious.read_bytes() == PRECIOUS
    assert Path(pub / "lr.png").is_symlink()
    lr = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "lr_range")
    assert lr["evidence"]["plot"].startswith("not written:") and "symbolic link" in lr["evidence"]["plot"]
    assert lr["evidence"]["suggested_lr"] is not None  # the sweep itself still reported
