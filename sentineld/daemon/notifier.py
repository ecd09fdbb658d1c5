"""What the daemon says, and where it goes: alerts, recoveries, crash notices and replay verdicts
become outbox notifications (delivered by the delivery thread) and Alertmanager alerts.

Texts come from :mod:`sentineld.daemon.messages`; notification ids are deterministic
(:func:`~sentineld.daemon.outbox.notification_id`), so a repeated enqueue after a restart is a
no-op: once per incident.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from sentineld.contracts.capture import CaptureError, open_capture
from sentineld.contracts.verdict import notification_text
from sentineld.daemon.delivery import LOG_TARGET, Destination
from sentineld.daemon.messages import agent_notice_text, alert_text, recovery_text, replay_failed_text
from sentineld.daemon.outbox import Notification, Outbox, notification_id
from sentineld.daemon.policy import Active
from sentineld.daemon.replay_runner import ReplayOutcome
from sentineld.daemon.runwatch import RunWatch

__all__ = ["Notifier"]

log = logging.getLogger("sentineld.daemon")


class Notifier:
    """Turns the daemon's decisions into notifications.

    Args:
        outbox: where notifications wait for delivery.
        dests: the configured destinations (each notification targets all of them and the log).
        clock: wall clock, seconds.
        alertmanager: an :class:`~sentineld.daemon.alertmanager.ActiveAlerts`, or None when no
            Alertmanager is configured.
    """

    def __init__(self, outbox: Outbox, dests: Sequence[Destination], clock: Callable[[], float],
                 alertmanager: Any = None) -> None:
        self.outbox = outbox
        self.dests = list(dests)
        self.clock = clock
        self.am = alertmanager
        self.am_lock = threading.Lock()
        self.delivery_wake = threading.Event()
        self.unwritten: list[Notification] = []  # could not be written to the outbox yet
        self.write_error: str | None = None

    def enqueue(self, note: Notification) -> None:
        """Put ``note`` in the outbox for every destination and wake the delivery thread.

        When the state dir cannot take it (disk full, read-only), ``note`` is held in memory and
        written by :meth:`retry_unwritten` (called every main-loop turn) once it can be; the
        daemon keeps running and ``status`` shows how many wait (``alerts_unwritten``).
        """
        note.targets = {LOG_TARGET: "pending", **{d.key: "pending" for d in self.dests}}
        note.created_s = self.clock()
        self._write(note)

    def _write(self, note: Notification) -> None:
        try:
            added = self.outbox.add(note)
        except OSError as exc:
            if all(n.id != note.id for n in self.unwritten):
                self.unwritten.append(note)
                log.error("cannot write notification %s to the state dir (%s); holding it in memory "
                          "and retrying", note.id, exc)
            self.write_error = str(exc)
            return
        self.unwritten = [n for n in self.unwritten if n.id != note.id]
        if not self.unwritten:
            self.write_error = None
        if added:
            self.delivery_wake.set()

    def agent_notices(self, rw: RunWatch) -> None:
        """Page what the agent said about itself (switched off, a capture not written); each once."""
        notices, rw.notices = rw.notices, []
        for rank, kind, step, message in notices:
            text = agent_notice_text(rw.run_id, rank, kind, step, message)
            if text is None:
                continue
            nid = notification_id(rw.incident_scope, kind, rank, step, message[:200])
            self.enqueue(Notification(id=nid, kind="alert", title=text[0], body=text[1], severity="warning",
                                      run=rw.run_id, signature="agent_stopped" if kind == "agent_error"
                                      else "capture_failed", step=step if step >= 0 else None,
                                      data={"rank": rank, "message": message}))

    def retry_unwritten(self) -> None:
        """Write the notifications held in memory since a failed write, oldest first."""
        for note in list(self.unwritten):
            self._write(note)
            if note in self.unwritten:
                return  # still failing: try again next turn

    def alert(self, rw: RunWatch, a: Active) -> None:
        """Notify that ``a`` fires in ``rw`` (outbox and Alertmanager)."""
        host = rw.meta.host if rw.meta else ""
        title, body = alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step, a.message,
                                 a.numbers, a.fix, a.module, host)
        nid = notification_id(rw.incident_scope, a.signature, a.module or "", a.step)
        self.enqueue(Notification(id=nid, kind="alert", title=title, body=body, severity=a.severity,
                                  run=rw.run_id, signature=a.signature, step=a.step,
                                  data={"ranks": a.ranks, "numbers": a.numbers, "module": a.module}))
        self.am_fire(rw, a, title, body)
        log.info("run %s: %s %s at step %d (ranks %s)", rw.run_id, a.severity, a.signature, a.step, a.ranks)

    def am_fire_quietly(self, rw: RunWatch, a: Active) -> None:
        """Track ``a`` in Alertmanager only (a rate-limited alert, or one restored at start)."""
        self.am_fire(rw, a, *alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step,
                                        a.message, a.numbers, a.fix, a.module))

    def crash_alert(self, rw: RunWatch, cap: Path, rank: int, step: int) -> None:
        """A training process died (exception, SIGTERM, SIGKILL with the disk ring): say so, with
        the exception, and how to replay the last steps it recorded."""
        try:
            with open_capture(cap) as c:
                reason = c.message or "no exception recorded"
        except CaptureError as exc:
            reason = f"(capture unreadable: {exc})"
        title = f"[sentineld] CRITICAL run {rw.run_id} crashed (rank {rank}) after step {step}"
        body = (f"The training process of run {rw.run_id} (rank {rank}) ended abnormally after step "
                f"{step}: {reason}\nIts last steps are in {cap.name}; the step that raised was never "
                f"completed, so replay the recorded ones: sentineld replay {rw.run_dir} --step {step}\n")
        self.enqueue(Notification(id=notification_id(rw.incident_scope, "crashed", cap.name), kind="alert",
                                  title=title, body=body, severity="critical", run=rw.run_id,
                                  signature="crashed", step=step, data={"rank": rank, "reason": reason}))
        log.info("run %s: crashed after step %d (rank %d): %s", rw.run_id, step, rank, reason)

    def recovery(self, rw: RunWatch, a: Active, step: int) -> None:
        """Notify that ``a`` no longer fires as of ``step``; resolve it in Alertmanager."""
        title, body = recovery_text(rw.run_id, a.signature, step, a.module)
        nid = notification_id(rw.incident_scope, a.signature, a.module or "", a.step, "recovered")
        self.enqueue(Notification(id=nid, kind="recovery", title=title, body=body, severity="info",
                                  run=rw.run_id, signature=a.signature, step=step))
        self.am_resolve(rw, a)

    def verdict(self, rw: RunWatch, cap: Path, outcome: ReplayOutcome) -> None:
        """Notify the replay's verdict on ``cap`` (or why it gave none)."""
        nid = notification_id(rw.incident_scope, "replay", cap.name)
        if outcome.report is not None:
            title, body = notification_text(outcome.report)
            sev = "critical" if outcome.report.get("phase") not in (None, "none") else "warning"
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity=sev,
                                run=rw.run_id, signature="replay", step=outcome.report.get("step"),
                                data=outcome.report)
        else:
            title, body = replay_failed_text(rw.run_id, cap.name, outcome.reason)
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity="warning",
                                run=rw.run_id, signature="replay_failed",
                                data={"result": outcome.result, "reason": outcome.reason})
        self.enqueue(note)

    def am_resolve(self, rw: RunWatch, a: Active) -> None:
        """Resolve ``a`` in Alertmanager (no-op without one)."""
        if self.am is not None:
            from sentineld.daemon.alertmanager import alert_labels  # noqa: PLC0415

            with self.am_lock:
                self.am.resolve(alert_labels(a.signature, rw.run_id, a.severity, a.module))

    def am_fire(self, rw: RunWatch, a: Active, title: str, body: str) -> None:
        """Fire ``a`` in Alertmanager (no-op without one)."""
        if self.am is None:
            return
        from sentineld.daemon.alertmanager import to_am_alert  # noqa: PLC0415

        with self.am_lock:
            self.am.fire(to_am_alert(signature=a.signature, run=rw.run_id, severity=a.severity,
                                     summary=title, description=body, step=a.step, ranks=a.ranks,
                                     host=rw.meta.host if rw.meta else "", starts_at=self.clock(),
                                     module=a.module))

    def am_flush(self, url: str) -> None:
        """Send what Alertmanager should hear now (retried on the next call when it fails)."""
        if self.am is None or not url:
            return
        from sentineld.daemon.alertmanager import flush  # noqa: PLC0415

        try:
            with self.am_lock:
                flush(self.am, url)
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("alertmanager forward failed (retrying): %s", exc)
