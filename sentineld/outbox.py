"""The persistent outbox: every notification is on disk before any delivery is tried.

One JSON file per notification under ``<state_dir>/outbox/``, named by a deterministic id
(run, signature, step): enqueueing the same incident again (after a daemon restart re-reads a
stream) finds the file and does nothing, so an incident is notified once. Delivery state is kept
per destination, so a destination that failed is retried (with doubling backoff) without sending
again to the ones that already took it. Files are replaced atomically (temp + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Notification", "Outbox", "notification_id"]


def notification_id(*parts: object) -> str:
    """A file-safe id from the parts that identify one incident (readable prefix + short hash)."""
    text = "|".join(str(p) for p in parts)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:80].strip("-")
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@dataclass
class Notification:
    """One message to deliver.

    Attributes:
        id: see :func:`notification_id`.
        kind: ``alert`` | ``recovery`` | ``verdict``.
        title, body: the text (never holds a destination URL or secret).
        severity: ``critical`` | ``warning`` | ``info``.
        run, signature, step: what it is about.
        data: machine-readable details (the verdict JSON for ``verdict``).
        targets: destination index (into the daemon's URL list) -> ``pending`` | ``delivered``.
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
    attempts: int = 0
    next_attempt_s: float = 0.0
    created_s: float = 0.0
    delivered_s: float | None = None
    last_error: str = ""

    @property
    def pending(self) -> bool:
        """True while some destination has not taken it."""
        return any(v != "delivered" for v in self.targets.values())


class Outbox:
    """Notifications on disk under ``directory``.

    Args:
        directory: created 0700 if missing.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, nid: str) -> Path:
        return self.dir / f"{nid}.json"

    def add(self, note: Notification) -> bool:
        """Store ``note`` unless one with its id exists; True when stored (i.e. new)."""
        path = self._path(note.id)
        if path.exists():
            return False
        self.save(note)
        return True

    def save(self, note: Notification) -> None:
        """Write ``note`` atomically (0600)."""
        path = self._path(note.id)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(note), f, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, nid: str) -> Notification | None:
        """The stored notification, or None if absent or unreadable."""
        try:
            return Notification(**json.loads(self._path(nid).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def __iter__(self) -> Iterator[Notification]:
        for path in sorted(self.dir.glob("*.json")):
            note = self.load(path.stem)
            if note is not None:
                yield note

    def due(self, now_s: float) -> list[Notification]:
        """Pending notifications whose next attempt time has come, oldest first."""
        out = [n for n in self if n.pending and n.next_attempt_s <= now_s]
        return sorted(out, key=lambda n: n.created_s)

    def pending_count(self) -> int:
        """Notifications some destination has not taken yet."""
        return sum(1 for n in self if n.pending)
