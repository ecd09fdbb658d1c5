"""The daemon's state directory files that other processes read: the lock (one daemon per state
dir), the pidfile, ``status.json`` and the key that names notification destinations; and the
name of the file that keeps the active verdict and crash alerts across restarts.

Everything here is written 0600 (the daemon also runs under umask 077).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from sentineld.contracts.rundir import RunDirError, make_private_dir
from sentineld.contracts.safeio import SafeDir, read_json, read_regular, write_atomic

__all__ = ["AlreadyRunning", "daemon_pid", "read_status", "write_status", "take_lock",
           "write_pidfile", "write_json_atomic", "destination_secret", "LOCK_NAME", "PID_NAME", "STATUS_NAME",
           "AM_EXTRAS", "read_state_json", "private_state_dir", "MAX_STATE_BYTES"]

log = logging.getLogger("sentineld.daemon")

#: Largest state file read (status, saved progress, an outbox record, the saved alerts): ours are
#: KiB; a notification's data is bounded by ``bound_data``. 16 MiB stops a runaway or planted file.
MAX_STATE_BYTES = 16 << 20

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


def _bad_lock(state_dir: Path, exc: OSError) -> RunDirError:
    """A lock file that is a link (``ELOOP``: filelock opens it ``O_NOFOLLOW``), a folder or not
    ours to open: not one a daemon of ours made; said plainly instead of a traceback."""
    return RunDirError(f"state dir {state_dir}: cannot open its lock {LOCK_NAME} ({exc.strerror or exc}); "
                       "use a state dir of your own (--state-dir)")


def daemon_pid(state_dir: Path) -> int | None:
    """Pid of the daemon holding ``state_dir``'s lock, or None when none runs (stale pidfile)."""
    lock = FileLock(str(state_dir / LOCK_NAME), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:  # (a TimeoutError, so an OSError: caught first)
        try:
            return int(read_regular(state_dir / PID_NAME, 64).strip())
        except (OSError, ValueError):
            return -1
    except OSError as exc:
        raise _bad_lock(state_dir, exc) from None
    lock.release()
    return None


def write_pidfile(state_dir: Path) -> Path:
    """Write this process's pid to the pidfile; returns its path (unlink it at exit)."""
    pidfile = state_dir / PID_NAME
    write_atomic(pidfile, f"{os.getpid()}\n", durable=False)
    return pidfile


def private_state_dir(path: Path) -> Path:
    """Create the state dir (0700) or check the existing one: ours and writable by no one else,
    since everything in it is read back (another user's FIFO or link there must never be).

    Raises:
        RunDirError: it cannot be created, is another user's, or others may write it (the
            message says what to do).
    """
    p = make_private_dir(path)
    try:
        SafeDir.open(p, owners=(os.geteuid(),), private=True, follow=True).close()
    except OSError as exc:
        raise RunDirError(f"state dir {exc}; use a state dir of your own (--state-dir)") from None
    return p


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The daemon's last ``status.json``, or None (missing, unreadable, or not a JSON object:
    a damaged or hand-edited file is no status)."""
    try:
        st = read_json(state_dir / STATUS_NAME, MAX_STATE_BYTES)
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def write_status(state_dir: Path, status: dict[str, Any]) -> None:
    """Replace ``status.json`` atomically (the safe writer)."""
    write_atomic(state_dir / STATUS_NAME, json.dumps(status, indent=1), durable=False)


def write_json_atomic(path: Path, obj: Any, durable: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` through the safe writer (0600; nan/inf allowed)."""
    write_atomic(path, json.dumps(obj, allow_nan=True), durable=durable)


def read_state_json(path: Path, what: str, limit: int = MAX_STATE_BYTES) -> Any:
    """A state file's JSON value, read like a run file (regular file only, never blocking on a
    FIFO, at most ``limit`` bytes, nested at most :data:`MAX_JSON_DEPTH` deep); None when missing.

    A damaged one (not JSON, too big or deep, a FIFO, a link, a device) is moved aside to
    ``<name>.damaged-<unix s>`` with one warning naming it and ``what`` is lost, never fatal:
    a daemon that cannot read its own state must still watch runs.
    """
    try:
        return read_json(path, limit)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        try:
            os.rename(path, aside)  # a rename never opens it (a FIFO) nor follows it (a link)
            moved = f"moved aside to {aside.name}"
        except OSError as err:
            moved = f"cannot move it aside: {err.strerror or err}"
        log.warning("state file %s is damaged (%s); %s, %s", path, exc, moved, what)
        return None


def destination_secret(state_dir: Path) -> bytes:
    """The state dir's random key for destination ids (created 0600 on first use)."""
    path = state_dir / "destinations.key"
    try:
        key = read_regular(path, 4096)
        if len(key) >= 16:
            return key
    except OSError:
        pass
    key = os.urandom(32)
    write_atomic(path, key)
    return key
