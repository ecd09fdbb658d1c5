"""deploy/systemd/sentineld.service: systemd itself accepts it, and it says what the docs promise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from .helpers import DEPLOY, require_binary

UNIT = DEPLOY / "systemd" / "sentineld.service"


def _settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit (all sections), every value of repeated keys in order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _verifiable_copy(tmp_path: Path, extra: str = "") -> Path:
    """The shipped unit with ExecStart's binary swapped for one that exists here.

    ``systemd-analyze verify`` fails when the ExecStart binary is missing; the shipped path
    (/usr/local/bin/sentineld) is only there on an installed host.
    """
    exe = shutil.which("true")
    assert exe is not None
    text = UNIT.read_text()
    text, n = re.subn(r"^ExecStart=/usr/local/bin/sentineld ", f"ExecStart={exe} ", text, flags=re.M)
    assert n == 1, "ExecStart=/usr/local/bin/sentineld ... not found exactly once"
    copy = tmp_path / "sentineld.service"
    copy.write_text(text + extra)
    return copy


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("systemd-analyze"), "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    result = _verify(_verifiable_copy(tmp_path))
    assert result.returncode == 0, result.stderr
    # verify exits 0 on unknown keys and bad values; they only show on stderr.
    assert result.stderr == "", result.stderr


def test_verify_would_catch_a_bad_key(tmp_path: Path) -> None:
    """Control: the check above is not vacuous."""
    result = _verify(_verifiable_copy(tmp_path, extra="\n[Service]\nRestartt=always\n"))
    assert "Unknown key" in result.stderr


def test_hardening_exposure_is_low(tmp_path: Path) -> None:
    """``systemd-analyze security`` scores 0 (locked down) to 10 (unprotected); default units ~9.6."""
    copy = _verifiable_copy(tmp_path)
    result = subprocess.run(
        [require_binary("systemd-analyze"), "security", "--offline=yes", "--threshold=30", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert score and float(score.group(1)) <= 3.0, result.stdout[-300:]


def test_unit_runs_the_daemon_in_the_foreground_with_the_documented_settings() -> None:
    s = _settings(UNIT.read_text())
    assert s["ExecStart"] == ["/usr/local/bin/sentineld start --foreground"]
    assert s["Type"] == ["exec"]  # the daemon does not send READY=1 yet
    assert s["Restart"] == ["on-failure"]
    assert s["KillSignal"] == ["SIGTERM"]
    assert s["TimeoutStopSec"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
    }.items():
        assert s[key] == [value], key
    env = dict(v.split("=", 1) for v in s["Environment"])
    assert env["PYTHONUNBUFFERED"] == "1"
    # The daemon's directories are the ones systemd creates and leaves writable.
    state_dirs = [f"/var/lib/{d}" for d in s["StateDirectory"][0].split()]
    assert env["SENTINELD_STATE_DIR"] in state_dirs
    assert env["SENTINELD_RUNS_DIR"] in state_dirs
    assert s["WantedBy"] == ["multi-user.target"]


def test_readme_documents_the_unit() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "sentineld.service" in text and "systemctl edit sentineld" in text
