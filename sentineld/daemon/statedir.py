"""The daemon's state directory files that other processes read: the lock (one daemon per state
dir), the pidfile, ``status.json`` and the key that names notification destinations; and the
name of the file that keeps the active verdict and crash alerts across restarts.

Everything here is written 0600 (the daemon also runs under umask 077).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

__all__ = ["AlreadyRunning", "daemon_pid", "read_status", "write_status", "take_lock",
           "write_pidfile", "write_json_atomic", "destination_secret", "LOCK_NAME", "PID_NAME", "STATUS_NAME",
           "AM_EXTRAS"]

LOCK_NAME, PID_NAME, STATUS_NAME = "daemon.lock", "daemon.pid", "status.json"

#: The firing verdict and crash alerts, re-sent by a restarted daemon
#: (:meth:`sentineld.daemon.notifier.Notifier.restore_extras`).
AM_EXTRAS = "am_extras.json"


class AlreadyRunning(Exception):
    """Another daemon holds this state dir's lock (the message gives its pid)."""


def take_lock(state_dir: Path) -> FileLock:
    """Hold ``state_dir``'s daemon lock (release it when the daemon stops).

    Raises:
        AlreadyRunning: another daemon holds it.
    """
    lock = FileLock(str(state_dir / LOCK_NAME), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        pid = daemon_pid(state_dir)
        raise AlreadyRunning(f"a sentineld daemon (pid {pid}) already runs with state dir "
                             f"{state_dir}; `sentineld stop` stops it") from None
    return lock


def daemon_pid(state_dir: Path) -> int | None:
    """Pid of the daemon holding ``state_dir``'s lock, or None when none runs (stale pidfile)."""
    lock = FileLock(str(state_dir / LOCK_NAME), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            return int((state_dir / PID_NAME).read_text().strip())
        except (OSError, ValueError):
            return -1
    lock.release()
    return None


def write_pidfile(state_dir: Path) -> Path:
    """Write this process's pid to the pidfile; returns its path (unlink it at exit)."""
    pidfile = state_dir / PID_NAME
    fd = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return pidfile


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The daemon's last ``status.json``, or None (missing, unreadable, or not a JSON object:
    a damaged or hand-edited file is no status)."""
    try:
        st = json.loads((state_dir / STATUS_NAME).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def write_status(state_dir: Path, status: dict[str, Any]) -> None:
    """Replace ``status.json`` atomically."""
    path = state_dir / STATUS_NAME
    tmp = path.with_name(STATUS_NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(status, f, indent=1)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file and rename (0600; nan/inf allowed)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, allow_nan=True)
    os.replace(tmp, path)


def destination_secret(state_dir: Path) -> bytes:
    """The state dir's random key for destination ids (created 0600 on first use)."""
    path = state_dir / "destinations.key"
    try:
        key = path.read_bytes()
        if len(key) >= 16:
            return key
    except OSError:
        pass
    key = os.urandom(32)
    tmp = path.with_name("destinations.key.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key
