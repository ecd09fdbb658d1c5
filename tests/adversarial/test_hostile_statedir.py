"""A second local user (``sntl_mallory``, a real Unix account) pre-creates the state dir root's
``sentineld start`` is pointed at (in a shared sticky folder: a state dir path in a unit file or a
README can be guessed).

Before: the background ``sentineld start`` opened ``<state dir>/daemon.log`` (``O_CREAT |
O_APPEND``, following links) before the daemon it started checked the state dir, so the daemon's
refusal went through her ``daemon.log`` link into a root file of her choice. And a ``daemon.lock``
link made ``sentineld status`` / ``stop`` die with a traceback. Now the state dir is checked
first (ours, writable by no one else) and nothing in it is opened otherwise; the log is opened
``O_NOFOLLOW``; a lock that is not a lock is a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.reliability.test_trust_users import (  # noqa: F401 - fixtures
    as_mallory, mallory, precious_file, public_dir, shared)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")

PRECIOUS = b"root's own file: never to be appended to\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _her_state_dir(mallory, shared: Path, link: str) -> tuple[Path, Path]:  # noqa: F811, ANN001
    pub = public_dir(shared)
    precious = precious_file(shared, PRECIOUS)
    state = pub / "sentineld-state"
    as_mallory(mallory, f"mkdir -m 777 {state} && ln -s {precious} {state}/{link}")
    return state, precious


def test_start_never_writes_its_log_through_her_link(mallory, shared, tmp_path):  # noqa: F811
    state, precious = _her_state_dir(mallory, shared, "daemon.log")
    r = _cli("start", "--state-dir", str(state), "--runs-dir", str(tmp_path / "runs"), "--metrics-port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{state} is owned by uid {mallory.pw_uid}" in r.stderr and "state dir of your own" in r.stderr
    assert precious.read_bytes() == PRECIOUS
    assert sorted(p.name for p in state.iterdir()) == ["daemon.log"]  # nothing of ours created there


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_lock_link_is_a_clear_error(mallory, shared, command):  # noqa: F811
    state, precious = _her_state_dir(mallory, shared, "daemon.lock")
    r = _cli(command, "--state-dir", str(state))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"state dir {state}: cannot open its lock daemon.lock" in r.stderr
    assert precious.read_bytes() == PRECIOUS


def test_a_config_file_she_wrote_is_refused(mallory, shared, tmp_path):  # noqa: F811
    """Before: root's daemon took her config: every alert to her webhook (``notify``)."""
    pub = shared / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    cfg = pub / "sentineld.toml"
    as_mallory(mallory, f"printf 'notify = [\"json://127.0.0.1:9/hers\"]\\n' > {cfg}")
    r = _cli("start", "--foreground", "--config", str(cfg), "--state-dir", str(tmp_path / "state"),
             "--runs-dir", str(tmp_path / "runs"), "--metrics-port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"config file {cfg} could have been written by another user" in r.stderr
    assert f"owned by uid {mallory.pw_uid}" in r.stderr
    assert not (tmp_path / "state" / "status.json").exists()  # no daemon ran on it


def test_a_fifo_config_never_blocks_the_start(tmp_path):
    """Before: ``open()`` of a FIFO config blocked ``sentineld start`` for good."""
    cfg = tmp_path / "config.toml"
    os.mkfifo(cfg, 0o600)
    r = _cli("start", "--foreground", "--config", str(cfg), "--state-dir", str(tmp_path / "state"),
             "--runs-dir", str(tmp_path / "runs"), "--metrics-port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot read config file {cfg}" in r.stderr and "is a FIFO, not a regular file" in r.stderr
