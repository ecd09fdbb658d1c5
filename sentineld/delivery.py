"""Delivering outbox notifications: the notifications log, apprise URLs, with retry and backoff.

apprise 2.x reports a failed delivery by its return value (``bool(result)`` is False), not by
raising (ecosystem-facts section 4), so every destination's result is checked and kept per
destination. A fresh ``Apprise`` object per send: the email plugin throttles sends from one object.
URLs are logged only in apprise's privacy form (tokens and passwords masked).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from .outbox import Notification, Outbox

__all__ = ["redact_url", "valid_url", "deliver_due", "LOG_TARGET", "append_log"]

log = logging.getLogger("sentineld.daemon")

#: Target key of the state dir's notifications log (always present).
LOG_TARGET = "log"


def redact_url(url: str) -> str:
    """``url`` with secrets masked (apprise's privacy form), or ``<invalid url>``."""
    import apprise  # noqa: PLC0415

    a = apprise.Apprise()
    if not a.add(url):
        return "<invalid url>"
    urls = a.urls(privacy=True)
    return urls[0] if urls else "<invalid url>"


def valid_url(url: str) -> bool:
    """True when apprise accepts ``url``."""
    import apprise  # noqa: PLC0415

    return bool(apprise.Apprise().add(url))


def _apprise_send(url: str, note: Notification, timeout_s: float) -> tuple[bool, str]:
    import apprise  # noqa: PLC0415

    a = apprise.Apprise()
    if not a.add(url):
        return False, "apprise rejected the URL"
    ntype = {"critical": apprise.NotifyType.FAILURE, "warning": apprise.NotifyType.WARNING}.get(
        note.severity, apprise.NotifyType.INFO)
    result = a.notify(body=note.body, title=note.title, notify_type=ntype)
    return bool(result), "" if result else f"delivery failed ({getattr(result, 'status', 'FAILURE')})"


def append_log(path: Path, note: Notification, now_s: float) -> None:
    """Append ``note`` to the notifications log (JSON lines, 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    line = json.dumps({"id": note.id, "time_s": now_s, "kind": note.kind, "severity": note.severity,
                       "run": note.run, "signature": note.signature, "step": note.step,
                       "title": note.title, "body": note.body, "data": note.data}) + "\n"
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def deliver_due(outbox: Outbox, urls: tuple[str, ...], log_path: Path, *, initial_s: float,
                max_s: float, clock: Callable[[], float] = time.time,
                send: Callable[[str, Notification, float], tuple[bool, str]] = _apprise_send,
                timeout_s: float = 30.0) -> tuple[int, int]:
    """Try every due notification once; return ``(delivered_now, failed_attempts)``.

    Each destination is marked ``delivered`` in the outbox right after it took the message, so a
    restart never sends to it again; a failing one gets ``next_attempt_s`` = now + backoff
    (``initial_s`` doubling per attempt up to ``max_s``).
    """
    delivered = failed = 0
    for note in outbox.due(clock()):
        for key, state in sorted(note.targets.items()):
            if state == "delivered":
                continue
            if key == LOG_TARGET:
                try:
                    append_log(log_path, note, clock())
                    ok, err = True, ""
                except OSError as exc:
                    ok, err = False, f"notifications log: {exc}"
            else:
                idx = int(key)
                if idx >= len(urls):
                    ok, err = True, ""  # destination removed from config since: nothing to do
                else:
                    try:
                        ok, err = send(urls[idx], note, timeout_s)
                    except Exception as exc:  # noqa: BLE001 - a plugin bug must not kill the daemon
                        ok, err = False, f"{type(exc).__name__}: {exc}"
                    if not ok:
                        log.warning("delivery of %s to %s failed: %s", note.id, redact_url(urls[idx]), err)
            if ok:
                note.targets[key] = "delivered"
            else:
                note.last_error = err
                failed += 1
            outbox.save(note)
        if note.pending:
            note.attempts += 1
            note.next_attempt_s = clock() + min(max_s, initial_s * 2 ** (note.attempts - 1))
        else:
            note.delivered_s = clock()
            delivered += 1
        outbox.save(note)
    return delivered, failed
