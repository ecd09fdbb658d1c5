"""Which daemon alerts to (re-)send to Alertmanager and when: :class:`ActiveAlerts` (pure) and
:func:`flush` (posts what is due through :func:`~sentineld.daemon.alertmanager.post_alerts`).

An alert without ``endsAt`` resolves itself ``resolve_timeout`` after it was last received, and
the client docs ask for re-sends every 30 s to 3 min: like Prometheus's rule manager, re-send every
``resend_s`` with ``endsAt = now + 4 * resend_s`` (or the daemon's hold), resolve with ``endsAt = now``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from sentineld.daemon.alertmanager import DAEMON_HOLD_S, MAX_RESEND_S, Alert, Labels, post_alerts, rfc3339

__all__ = ["ActiveAlerts", "daemon_alerts", "flush"]


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


@dataclass
class _Entry:
    alert: Alert
    sent_s: float | None  # Unix time of the last successful post; None = never / changed since


class ActiveAlerts:
    """Which alerts to (re-)send to Alertmanager and when; no I/O.

    Firing alerts are due when new, when their annotations changed, and every ``resend_s``
    after. Each is sent with ``endsAt = now + 4 * resend_s`` (Prometheus's rule manager uses
    the same factor), so Alertmanager resolves it by itself if this process stops re-sending.
    A resolved alert is due once with ``endsAt = now`` and kept until a post succeeded.

    Example::

        active = ActiveAlerts(resend_s=60.0)
        active.fire(alert)                    # alert from to_am_alert()
        due = active.due()                    # [alert with endsAt = now + 240 s]
        post_alerts(url, due); active.mark_sent(due)
        active.due()                          # [] until 60 s have passed

    Args:
        resend_s: seconds between re-sends of a firing alert; default 60, at most
            :data:`MAX_RESEND_S` (Alertmanager's client docs: every 30 s to 3 min). An alert
            whose sender stopped resolves ``4 * resend_s`` after the last send.
        clock: returns Unix seconds; ``time.time`` by default (``endsAt`` is wall-clock time).
        hold_s: ``endsAt`` of a firing alert is ``now + hold_s``; None = ``4 * resend_s`` (what
            Prometheus does). The daemon holds its alerts for :data:`DAEMON_HOLD_S` so that a
            stopped daemon does not resolve an incident that is still there (issue 16).

    Raises:
        ValueError: ``resend_s`` not in (0, MAX_RESEND_S], or ``hold_s`` shorter than
            ``2 * resend_s`` (one lost re-send would resolve the alert).
    """

    #: endsAt of a firing alert = now + TTL_FACTOR * resend_s (Prometheus: 4 * resend delay).
    TTL_FACTOR = 4

    def __init__(
        self,
        resend_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.time,
        hold_s: float | None = None,
    ) -> None:
        if not 0 < resend_s <= MAX_RESEND_S:
            raise ValueError(
                f"resend_s must be in (0, {MAX_RESEND_S:g}] seconds (Alertmanager's client docs ask "
                f"for re-sends every 30 s to 3 min), got {resend_s!r}"
            )
        self.resend_s = float(resend_s)
        self.hold_s = self.TTL_FACTOR * self.resend_s if hold_s is None else float(hold_s)
        if not self.hold_s >= 2 * self.resend_s:
            raise ValueError(f"hold_s must be >= 2 * resend_s ({2 * self.resend_s:g} s), got {hold_s!r}")
        self._clock = clock
        self._firing: dict[tuple[tuple[str, str], ...], _Entry] = {}
        self._resolving: dict[tuple[tuple[str, str], ...], Alert] = {}

    def __len__(self) -> int:
        """Number of firing alerts."""
        return len(self._firing)

    def firing(self) -> list[Labels]:
        """Label sets of the firing alerts (the daemon resolves a run's verdict/crash alerts by them)."""
        return [dict(e.alert["labels"]) for e in self._firing.values()]

    def firing_alerts(self) -> list[Alert]:
        """Copies of the firing alerts as last fired (labels, annotations, startsAt; no endsAt):
        what a restarted daemon fires again (:meth:`fire` keeps their startsAt)."""
        return [json.loads(json.dumps(e.alert)) for e in self._firing.values()]

    def fire(self, alert: Alert) -> None:
        """Start or update a firing alert (same labels = same alert; last annotations win).

        Args:
            alert: as built by :func:`to_am_alert`; its ``endsAt`` is ignored.

        Raises:
            ValueError: the alert has no ``labels.alertname``.
        """
        labels = alert.get("labels") or {}
        if not labels.get("alertname"):
            raise ValueError(f"alert needs labels.alertname, got labels {labels!r}")
        key = _key(labels)
        self._resolving.pop(key, None)
        alert = {k: v for k, v in alert.items() if k != "endsAt"}
        entry = self._firing.get(key)
        if entry is None:
            self._firing[key] = _Entry(alert, None)
            return
        if alert.get("annotations") != entry.alert.get("annotations"):
            entry.sent_s = None  # changed: due now
        alert["startsAt"] = entry.alert.get("startsAt", alert.get("startsAt"))
        entry.alert = alert

    def resolve(self, labels: Labels) -> bool:
        """Resolve the firing alert with these labels; it is sent once with ``endsAt = now``.

        Args:
            labels: the alert's full label set.

        Returns:
            True if such an alert was firing.
        """
        entry = self._firing.pop(_key(labels), None)
        if entry is None:
            return False
        resolved = dict(entry.alert)
        resolved["endsAt"] = rfc3339(self._clock(), "now")
        self._resolving[_key(labels)] = resolved
        return True

    def due(self) -> list[Alert]:
        """Alerts to post now: resolutions, new or changed alerts, and re-sends.

        Returns:
            Copies with ``endsAt`` set; pass the same list to :meth:`mark_sent` after a
            successful post.
        """
        now = self._clock()
        out = [dict(a) for a in self._resolving.values()]
        ends_at = rfc3339(now + self.hold_s, "endsAt")
        for entry in self._firing.values():
            if entry.sent_s is None or now - entry.sent_s >= self.resend_s:
                out.append({**entry.alert, "endsAt": ends_at})
        return out

    def mark_sent(self, alerts: Iterable[Alert]) -> None:
        """Record a successful post of ``alerts`` (as returned by :meth:`due`)."""
        now = self._clock()
        for alert in alerts:
            key = _key(alert["labels"])
            if key in self._resolving and self._resolving[key].get("endsAt") == alert.get("endsAt"):
                del self._resolving[key]
            elif key in self._firing:
                entry = self._firing[key]
                if entry.alert.get("annotations") == alert.get("annotations"):
                    entry.sent_s = now  # else it changed after due(): still due


def flush(
    active: ActiveAlerts,
    base_url: str,
    timeout_s: float = 5.0,
    post: Callable[[str, Sequence[Alert], float], None] = post_alerts,
) -> int:
    """Post what :meth:`ActiveAlerts.due` returns and mark it sent.

    Call it on the daemon's loop tick (every few seconds); most calls send nothing.

    Args:
        active: the alert state.
        base_url: Alertmanager's URL.
        timeout_s: per-request timeout in seconds.
        post: the transport, :func:`post_alerts` by default.

    Returns:
        Number of alerts posted.

    Raises:
        AlertmanagerError: the post failed; nothing is marked sent, so the next call retries.
    """
    due = active.due()
    if due:
        post(base_url, due, timeout_s)
        active.mark_sent(due)
    return len(due)


def daemon_alerts(url: str | None) -> ActiveAlerts | None:
    """The daemon's Alertmanager alerts (None without an Alertmanager ``url``): re-sent every
    60 s, each held :data:`DAEMON_HOLD_S` past its last re-send, so a stopped daemon does not
    resolve an incident (issue 16)."""
    return ActiveAlerts(resend_s=60.0, hold_s=DAEMON_HOLD_S) if url else None
