"""What the daemon says, and where it goes: alerts, recoveries, crash notices and replay verdicts
become outbox notifications (delivered by the delivery thread) and Alertmanager alerts.

Alertmanager sees one incident per run (issue 16): the signature alert is the page; it is
re-posted when more ranks join, carries why no replay comes (``replay`` annotation), and the
replay's verdict and a crash are their own alerts in the incident's group, resolved with it
(:mod:`sentineld.daemon.am_incident`).

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
from sentineld.contracts.records import AGENT_ERROR
from sentineld.contracts.render import replay_command
from sentineld.contracts.rundir import parse_capture_name
from sentineld.contracts.triggers import CRASH
from sentineld.contracts.verdict import notification_text
from sentineld.daemon.am_incident import (
    EXTRA_SIGNATURES,
    NO_RECIPE,
    crash_alert,
    incident_annotations,
    incident_severity,
    verdict_alert,
    verdict_may_come,
)
from sentineld.daemon.delivery import LOG_TARGET, Destination
from sentineld.daemon.messages import agent_notice_text, alert_text, recovery_text, replay_failed_text
from sentineld.daemon.outbox import Notification, Outbox, notification_id
from sentineld.daemon.policy import Active
from sentineld.daemon.replay_runner import ReplayOutcome
from sentineld.daemon.runwatch import RunWatch
from sentineld.daemon.statedir import read_state_json, write_json_atomic

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
        replay_enabled: the daemon replays captures (``replay`` in its config); a run without a
            recipe then says in its alerts that no replay will come.
        extras_path: where the firing verdict and crash alerts are kept (the state dir's
            ``am_extras.json``), so that a restarted daemon re-sends them (:meth:`restore_extras`);
            None keeps them in memory only.
        host: the name of this daemon's host in its Alertmanager alerts (label and text).
    """

    def __init__(self, outbox: Outbox, dests: Sequence[Destination], clock: Callable[[], float],
                 alertmanager: Any = None, *, replay_enabled: bool = True, extras_path: Path | None = None,
                 host: str = "") -> None:
        self.replay_enabled = replay_enabled
        self.extras_path = extras_path
        self.host = host
        self.outbox = outbox
        self.dests = list(dests)
        self.clock = clock
        self.am = alertmanager
        self.am_lock = threading.Lock()
        self.delivery_wake = threading.Event()
        self.unwritten: list[Notification] = []  # could not be written to the outbox yet
        self.write_error: str | None = None

    def host_of(self, rw: RunWatch) -> str:
        """The host named in ``rw``'s alerts: this daemon's (config ``host``), which watches the
        ranks of its host; else the one in the run's ``run.json``."""
        return self.host or (rw.meta.host if rw.meta else "")

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
        for rank, kind, step, message in rw.take_notices():
            text = agent_notice_text(rw.run_id, rank, kind, step, message)
            if text is None:
                continue
            nid = notification_id(rw.incident_scope, kind, rank, step, message[:200])
            self.enqueue(Notification(id=nid, kind="alert", title=text[0], body=text[1], severity="warning",
                                      run=rw.run_id, signature="agent_stopped" if kind == AGENT_ERROR
                                      else "capture_failed", step=step if step >= 0 else None,
                                      data={"rank": rank, "message": message}))

    def status(self) -> dict[str, Any]:
        """Its part of the daemon's ``status.json``."""
        return {"alerts_pending": self.outbox.pending_count(), "notify": [d.shown for d in self.dests],
                "alerts_unwritten": len(self.unwritten), "state_write_error": self.write_error}

    def state_write_failed(self, what: str) -> None:
        """The daemon could not write ``what`` (progress, status) to its state dir: shown in
        ``status`` (``state_write_error``) until the next notification written clears it."""
        self.write_error = what

    def retry_unwritten(self) -> None:
        """Write the notifications held in memory since a failed write, oldest first."""
        for note in list(self.unwritten):
            self._write(note)
            if note in self.unwritten:
                return  # still failing: try again next turn

    def alert(self, rw: RunWatch, a: Active) -> None:
        """Notify that ``a`` fires in ``rw`` (outbox and Alertmanager)."""
        host = self.host_of(rw)
        title, body = alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step, a.message,
                                 a.numbers, a.fix, a.module, host, run_dir=str(rw.run_dir),
                                 replay_note=self.replay_note(rw))
        nid = notification_id(rw.incident_scope, a.signature, a.module or "", a.step)
        self.enqueue(Notification(id=nid, kind="alert", title=title, body=body, severity=a.severity,
                                  run=rw.run_id, signature=a.signature, step=a.step,
                                  data={"ranks": a.ranks, "numbers": a.numbers, "module": a.module}))
        # Alertmanager's copy without the replay note: its ``replay`` annotation says the same
        self.am_fire(rw, a, *alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step, a.message,
                                        a.numbers, a.fix, a.module, host, run_dir=str(rw.run_dir)))
        log.info("run %s: %s %s at step %d (ranks %s)", rw.run_id, a.severity, a.signature, a.step, a.ranks)

    def replay_note(self, rw: RunWatch) -> str:
        """Whether the capture's verdict will follow this alert, for the alert's body."""
        no_replay = self.am_annotations(rw).get("replay")
        if no_replay:
            return f"automatic replay: {no_replay}"
        if not self.replay_enabled:
            return "automatic replay: off (the daemon runs with --no-replay); replay by hand as above"
        return "automatic replay: on; the verdict on the capture follows in its own message"

    def am_fire_quietly(self, rw: RunWatch, a: Active) -> None:
        """Track ``a`` in Alertmanager only (a rate-limited alert, or one restored at start)."""
        self.am_fire(rw, a, *alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step,
                                        a.message, a.numbers, a.fix, a.module, self.host_of(rw),
                                        run_dir=str(rw.run_dir)))

    def crashes(self, rw: RunWatch, caps: Sequence[Path]) -> None:
        """Alert each crash capture among the new captures ``caps`` of ``rw``."""
        for cap in caps:
            parsed = parse_capture_name(cap.name)
            if parsed is not None and parsed[2] == CRASH:
                self.crash_alert(rw, cap, parsed[0], parsed[1])

    def crash_alert(self, rw: RunWatch, cap: Path, rank: int, step: int) -> None:
        """A training process died (exception, SIGTERM, SIGKILL with the disk ring): say so, with
        the exception, and how to replay the last steps it recorded."""
        try:
            with open_capture(cap) as c:
                reason = c.message or "no exception recorded"
        except CaptureError as exc:
            reason = f"(capture unreadable: {exc})"
        if rw.crash_paged:
            # One page per run: a process dies once, and the other ranks' crash captures say the
            # same; whoever can write a run dir could otherwise page for each file she makes.
            log.info("run %s: another crash capture %s (rank %d, step %d; paged once per run): %s",
                     rw.run_id, cap.name, rank, step, reason)
            return
        rw.crash_paged = True
        title = f"[sentineld] CRITICAL run {rw.run_id} crashed (rank {rank}) after step {step}"
        body = (f"The training process of run {rw.run_id} (rank {rank}) ended abnormally after step "
                f"{step}: {reason}\nIts last steps are in {cap.name}; the step that raised was never "
                f"completed, so replay the recorded ones: {replay_command(str(rw.run_dir), step)}\n")
        self.enqueue(Notification(id=notification_id(rw.incident_scope, "crashed"), kind="alert",
                                  title=title, body=body, severity="critical", run=rw.run_id,
                                  signature="crashed", step=step, data={"rank": rank, "reason": reason}))
        self.am_extra(rw, "crashed", title, body, step, rank)
        log.info("run %s: crashed after step %d (rank %d): %s", rw.run_id, step, rank, reason)

    def recovery(self, rw: RunWatch, a: Active, step: int) -> None:
        """Notify that ``a`` no longer fires as of ``step``; resolve it in Alertmanager."""
        title, body = recovery_text(rw.run_id, a.signature, step, a.module)
        nid = notification_id(rw.incident_scope, a.signature, a.module or "", a.step, "recovered")
        self.enqueue(Notification(id=nid, kind="recovery", title=title, body=body, severity="info",
                                  run=rw.run_id, signature=a.signature, step=step))
        self.am_resolve(rw, a)

    def verdict(self, rw: RunWatch, cap: Path, outcome: ReplayOutcome) -> None:
        """Notify the replay's verdict on ``cap`` (or why it gave none); a ``no_recipe`` outcome is
        no news: the incident's alert said so from its first notification."""
        nid = notification_id(rw.incident_scope, "replay", cap.name)
        if outcome.result == NO_RECIPE:
            return
        if outcome.report is not None:
            title, body = notification_text(outcome.report)
            sev = "critical" if outcome.report.get("phase") not in (None, "none") else "warning"
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity=sev,
                                run=rw.run_id, signature="replay", step=outcome.report.get("step"),
                                data=outcome.report)
        else:
            # One "replay failed" page per run (issue 20 item 7): its id names no capture, so the
            # outbox keeps the first and drops the rest (200 junk captures page once, not 200 times).
            nid = notification_id(rw.incident_scope, "replay_failed")
            title, body = replay_failed_text(rw.run_id, cap.name, outcome.reason)
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity="warning",
                                run=rw.run_id, signature="replay_failed",
                                data={"result": outcome.result, "reason": outcome.reason})
        self.enqueue(note)
        parsed = parse_capture_name(cap.name)
        self.am_extra(rw, "replay", note.title, note.body, note.step, parsed[0] if parsed else None)

    def am_resolve(self, rw: RunWatch, a: Active) -> None:
        """Resolve ``a`` in Alertmanager (no-op without one)."""
        if self.am is not None:
            from sentineld.daemon.alertmanager import alert_labels  # noqa: PLC0415

            with self.am_lock:
                self.am.resolve(alert_labels(a.signature, rw.run_id, a.severity, a.module,
                                             self.host_of(rw) or None))

    def am_fire(self, rw: RunWatch, a: Active, title: str, body: str) -> None:
        """Fire ``a`` in Alertmanager (no-op without one)."""
        if self.am is None:
            return
        from sentineld.daemon.alertmanager import to_am_alert  # noqa: PLC0415

        with self.am_lock:
            self.am.fire(to_am_alert(signature=a.signature, run=rw.run_id, severity=a.severity,
                                     summary=title, description=body, step=a.step, ranks=a.ranks,
                                     host=self.host_of(rw), starts_at=self.clock(),
                                     module=a.module, extra_annotations=self.am_annotations(rw)))

    def am_annotations(self, rw: RunWatch) -> dict[str, str]:
        """Annotations every Alertmanager alert of ``rw`` carries (why no replay comes)."""
        if rw.meta is None:
            return {}
        return incident_annotations(rw.meta.recipe, self.replay_enabled, rw.run_id,
                                    verdict_may_come(rw.meta.extra))

    def am_refresh(self, rw: RunWatch, a: Active) -> None:
        """Re-post a firing alert whose ranks grew, so the page lists every rank."""
        host = self.host_of(rw)
        self.am_fire(rw, a, *alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step, a.message,
                                        a.numbers, a.fix, a.module, host, run_dir=str(rw.run_dir)))

    def am_extra(self, rw: RunWatch, kind: str, title: str, body: str, step: int | None,
                 rank: int | None) -> None:
        """Post the replay verdict (``kind="replay"``) or a crash (``"crashed"``) as an alert in
        the incident's group; a new one replaces the run's last of that kind (whose severity
        may differ). No-op without Alertmanager."""
        if self.am is None:
            return
        make = verdict_alert if kind == "replay" else crash_alert
        alert = make(run=rw.run_id, severity=incident_severity(rw.active.values()), title=title,
                     body=body, step=step, rank=rank, host=self.host_of(rw),
                     starts_at=self.clock())
        with self.am_lock:
            for labels in self.am.firing():
                if labels.get("run") == rw.run_id and labels.get("signature") == kind:
                    self.am.resolve(labels)
            self.am.fire(alert)
            self._save_extras()
        self.delivery_wake.set()

    def am_resolve_extras(self, rw: RunWatch) -> None:
        """The run recovered: its verdict and crash alerts resolve with the incident."""
        if self.am is None:
            return
        with self.am_lock:
            for labels in self.am.firing():
                if labels.get("run") == rw.run_id and labels.get("signature") in EXTRA_SIGNATURES:
                    self.am.resolve(labels)
            self._save_extras()

    def _save_extras(self) -> None:
        """Keep the firing verdict and crash alerts in the state dir (call with ``am_lock`` held).
        The signature alerts need no file: the runs' saved progress restores them."""
        if self.extras_path is None or self.am is None:
            return
        extras = [a for a in self.am.firing_alerts() if a["labels"].get("signature") in EXTRA_SIGNATURES]
        try:
            write_json_atomic(self.extras_path, extras)
        except OSError as exc:  # a full disk: they are still sent; only a restart would lose them
            log.warning("cannot save the active verdict/crash alerts to %s: %s", self.extras_path, exc)

    def restore_extras(self) -> int:
        """Fire again the verdict and crash alerts the last daemon left firing, as they were
        (same labels, annotations and startsAt): Alertmanager keeps an alert only while it is
        re-sent, and their incident is not over because the daemon restarted. They resolve with
        their run's incident as before. Returns how many; an unreadable file restores none."""
        if self.extras_path is None or self.am is None:
            return 0
        # bounded, regular file only, depth-checked; a damaged one is moved aside (statedir)
        saved = read_state_json(self.extras_path, "the verdict/crash alerts it held are not restored")
        n = 0
        with self.am_lock:
            for alert in saved if isinstance(saved, list) else []:
                if not _restorable(alert):
                    # Alertmanager answers 400 to the whole post for one malformed alert, which
                    # would hold every live alert back with it on each retry.
                    log.warning("saved alert in %s is not a well-formed verdict/crash alert; not restored: %.200r",
                                self.extras_path, alert)
                    continue
                self.am.fire(alert)
                n += 1
        if n:
            log.info("re-sending %d verdict/crash alert(s) the last daemon left active", n)
        self.delivery_wake.set()
        return n

    def am_flush(self, url: str) -> None:
        """Send what Alertmanager should hear now (retried on the next call when it fails)."""
        if self.am is None or not url:
            return
        from sentineld.daemon.am_active import flush  # noqa: PLC0415

        try:
            with self.am_lock:
                flush(self.am, url)
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("alertmanager forward failed (retrying): %s", exc)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _restorable(alert: Any) -> bool:
    """True for a saved alert Alertmanager accepts: string labels (with ``alertname`` and a
    verdict/crash ``signature``) and annotations, string ``startsAt`` / ``generatorURL``."""
    if not isinstance(alert, dict) or not _str_map(alert.get("labels")):
        return False
    labels = alert["labels"]
    return (bool(labels.get("alertname")) and labels.get("signature") in EXTRA_SIGNATURES
            and _str_map(alert.get("annotations", {}))
            and all(isinstance(alert.get(k, ""), str) for k in ("startsAt", "generatorURL")))
