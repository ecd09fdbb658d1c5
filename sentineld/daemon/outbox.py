"""The persistent outbox: every notification is on disk before any delivery is tried.

One JSON file per notification, named by a deterministic id (run, signature, step): enqueueing the
same incident again (after a daemon restart re-reads a stream) finds the file and does nothing, so
an incident is notified once. Pending notifications live in ``<state_dir>/outbox/``; once every
destination took one it moves (one atomic rename) to ``outbox/delivered/``, so the delivery loop
only ever reads the pending ones.

Delivery state is kept per destination (``targets``: destination key -> state):

- ``pending``: not sent yet, or the last attempt failed (retried with doubling backoff);
- ``sending``: written and fsynced *before* the send starts. A daemon that finds this state after
  a restart knows it died during that send and cannot know whether the destination took it: the
  delivery layer then decides per destination (see :mod:`sentineld.daemon.delivery`);
- ``delivered``: the destination took it; never sent there again;
- ``dropped``: the destination is no longer configured.

Every write is temp file + fsync + rename, so a SIGKILL at any point leaves the previous or the new
state, never a torn file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from sentineld.contracts.safeio import read_json
from sentineld.daemon.statedir import MAX_STATE_BYTES, read_state_json, write_json_atomic

__all__ = ["Notification", "Outbox", "notification_id", "read_notification", "read_notifications", "PENDING",
           "SENDING", "DELIVERED", "DROPPED", "bound_text", "bound_data", "MAX_TITLE_CHARS", "MAX_BODY_CHARS",
           "MAX_DATA_BYTES"]

PENDING, SENDING, DELIVERED, DROPPED = "pending", "sending", "delivered", "dropped"

#: Bounds of one notification. A page is read by a person: 16k characters is several screens, and
#: a chat message (Slack: 40k) or a mail with more is no more useful. A 20 MB exception message
#: once made a 20 MB webhook post, a 40 MB outbox record and an email retried forever.
MAX_TITLE_CHARS = 300
MAX_BODY_CHARS = 16_000
MAX_DATA_BYTES = 64 << 10


def bound_text(text: str, limit: int) -> str:
    """``text`` if at most ``limit`` characters, else its head with a line saying what was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 80)
    return f"{text[:keep]}\n[cut: {len(text) - keep} more characters of {len(text)}]"


def _shrink(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, str):
        return bound_text(obj, 2000)
    if depth > 8:
        return "[cut: nested too deep]"
    if isinstance(obj, dict):
        items = list(obj.items())
        out = {str(k)[:200]: _shrink(v, depth + 1) for k, v in items[:200]}
        if len(items) > 200:
            out["_cut"] = f"{len(items) - 200} more keys"
        return out
    if isinstance(obj, (list, tuple)):
        out_l = [_shrink(v, depth + 1) for v in obj[:200]]
        if len(obj) > 200:
            out_l.append(f"[cut: {len(obj) - 200} more items]")
        return out_l
    return obj


def bound_data(data: dict[str, Any], limit: int = MAX_DATA_BYTES) -> dict[str, Any]:
    """``data`` if its JSON is at most ``limit`` bytes, else long strings and lists cut (marked)."""
    try:
        if len(json.dumps(data, allow_nan=True)) <= limit:
            return data
        small = _shrink(data)
        if len(json.dumps(small, allow_nan=True)) <= limit:
            return {**small, "_cut": "long values were cut to bound the notification"}
    except (TypeError, ValueError, RecursionError):
        pass
    return {"_cut": f"details over {limit} bytes were dropped", "keys": [str(k)[:100] for k in list(data)[:50]]}


def notification_id(*parts: object) -> str:
    """A file-safe id from the parts that identify one incident (readable prefix + short hash)."""
    text = "|".join(str(p) for p in parts)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:80].strip("-")
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@dataclass
class Notification:
    """One message to deliver.

    Attributes:
        id: see :func:`notification_id`; also shown to receivers (body footer, ``X-Sentineld-Id``).
        kind: ``alert`` | ``recovery`` | ``verdict``.
        title, body: the text (never holds a destination URL or secret).
        severity: ``critical`` | ``warning`` | ``info``.
        run, signature, step: what it is about.
        data: machine-readable details (the verdict JSON for ``verdict``).
        targets: destination key -> ``pending`` | ``sending`` | ``delivered`` | ``dropped``.
        resent: destination key -> times it was sent again after a daemon died during its send
            (each such copy is marked as a possible repeat, with the same id).
        attempts, next_attempt_s, created_s, delivered_s, last_error: delivery bookkeeping.
    """

    id: str
    kind: str
    title: str
    body: str
    severity: str = "critical"
    run: str = ""
    signature: str = ""
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)
    resent: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    next_attempt_s: float = 0.0
    created_s: float = 0.0
    delivered_s: float | None = None
    last_error: str = ""

    def __post_init__(self) -> None:
        self.title = bound_text(str(self.title), MAX_TITLE_CHARS)
        self.body = bound_text(str(self.body), MAX_BODY_CHARS)
        self.data = bound_data(self.data if isinstance(self.data, dict) else {"value": self.data})

    @property
    def pending(self) -> bool:
        """True while some destination has not taken it."""
        return any(v not in (DELIVERED, DROPPED) for v in self.targets.values())


_FIELDS = {f.name for f in fields(Notification)}


def _write_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    write_json_atomic(path, obj, durable=durable)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_notification(path: Path, move_damaged: bool = False) -> Notification | None:
    """The notification stored at ``path``; None when it is unreadable, not JSON or not one.

    Read like a run file (:func:`sentineld.daemon.statedir.read_state_json`: bounded size and
    depth, regular files only). ``move_damaged``: the daemon's own outbox moves a damaged record
    aside (with a warning) so it is not read again; a read-only reader (``sentineld report``) leaves it.
    """
    try:
        if move_damaged:
            obj = read_state_json(path, "that notification is not sent")
        else:
            obj = read_json(path, MAX_STATE_BYTES)
        if not isinstance(obj, dict):
            return None
        return Notification(**{k: v for k, v in obj.items() if k in _FIELDS})
    except (OSError, ValueError, TypeError):
        return None


def read_notifications(directory: Path) -> list[Notification]:
    """Every notification under an outbox ``directory``, pending then delivered, read-only.

    Unlike :class:`Outbox` (whose constructor creates the directories and removes the ``*.json.tmp``
    of a save cut short), this changes nothing: a reader beside a running daemon (``sentineld
    report``) must not remove the temp file of a save the daemon has in flight. [] when
    ``directory`` does not exist; unreadable files are skipped.
    """
    paths = sorted(directory.glob("*.json")) + sorted((directory / "delivered").glob("*.json"))
    return [n for n in map(read_notification, paths) if n is not None]


class Outbox:
    """Notifications on disk under ``directory`` (pending) and ``directory/delivered``.

    Args:
        directory: created 0700 if missing.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.done_dir = self.dir / "delivered"
        for d in (self.dir, self.done_dir):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
        for stale in self.dir.glob("*.json.tmp"):  # a save cut short by a crash: the old file stands
            stale.unlink(missing_ok=True)

    def _path(self, nid: str) -> Path:
        return self.dir / f"{nid}.json"

    def _done_path(self, nid: str) -> Path:
        return self.done_dir / f"{nid}.json"

    def known(self, nid: str) -> bool:
        """True when a notification with this id was ever stored (pending or delivered)."""
        return self._path(nid).exists() or self._done_path(nid).exists()

    def add(self, note: Notification) -> bool:
        """Store ``note`` unless one with its id exists; True when stored (i.e. new)."""
        if self.known(note.id):
            return False
        self.save(note)
        _fsync_dir(self.dir)
        return True

    def save(self, note: Notification, durable: bool = True) -> None:
        """Write ``note`` atomically (0600, temp + rename).

        Args:
            durable: fsync before the rename, so the state survives a power loss too. Without
                it the write still survives the death of the process (it is in the page cache),
                and it is much faster: used for the ``delivered`` mark right after a send, where
                every millisecond is a millisecond in which a SIGKILL causes a repeat.
        """
        _write_atomic(self._path(note.id), asdict(note), durable)

    def finish(self, note: Notification) -> None:
        """Save ``note`` (every destination settled) and move it to ``delivered/`` in one rename."""
        self.save(note)
        os.replace(self._path(note.id), self._done_path(note.id))
        _fsync_dir(self.dir)

    def __iter__(self) -> Iterator[Notification]:
        """Pending notifications."""
        for path in sorted(self.dir.glob("*.json")):
            note = read_notification(path, move_damaged=True)
            if note is not None:
                yield note

    def delivered(self) -> Iterator[Notification]:
        """Notifications every destination took."""
        for path in sorted(self.done_dir.glob("*.json")):
            note = read_notification(path, move_damaged=True)
            if note is not None:
                yield note

    def due(self, now_s: float) -> list[Notification]:
        """Pending notifications whose next attempt time has come, oldest first."""
        out = [n for n in self if n.next_attempt_s <= now_s]
        return sorted(out, key=lambda n: (n.created_s, n.id))

    def pending_count(self) -> int:
        """Notifications some destination has not taken yet."""
        return sum(1 for _ in self.dir.glob("*.json"))
