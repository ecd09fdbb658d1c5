"""The daemon: watch run directories, alert on signatures, deliver, and replay captures.

Threads, each waiting on the stop event with a timeout (never a bare sleep):

- main: on file events (watchdog) or every ``poll_s``, polls each run (:class:`RunWatch`),
  evaluates signatures over each rank's window (a stream that is behind is read in bounded
  chunks, each evaluated), enqueues alerts and recovery notices in the outbox, queues replays
  for new captures and recoveries for on-disk rings of dead processes, and writes
  ``status.json``;
- delivery: sends due outbox notifications (retry with backoff; crash protocol in
  :mod:`sentineld.daemon.delivery`);
- replay: runs one replay subprocess at a time (timeout, memory limit) and enqueues its verdict;
- recover: turns the on-disk ring of a training process that died without closing (SIGKILL,
  OOM killer) into a ``crash`` capture (:mod:`sentineld.daemon.ring_recovery`), which is then replayed.

Once per incident comes from the outbox's deterministic ids plus saved per-run progress
(stream offsets, the window's start, active signatures, captures seen) and per-capture replay
records. An alert is in the outbox before the progress that says it was sent is saved, so a
crash between the two repeats the enqueue (a no-op), never loses the alert. A signature of a run
that fires again within ``alert_interval_s`` of its last alert is tracked but not notified again
(nor is its recovery).

Everything the daemon writes is private (umask 077 while it runs: directories 0700, files 0600),
and secrets in notification URLs never reach a log line, ``status.json`` or the outbox.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock, Timeout

from .config import DaemonConfig
from .delivery import LOG_TARGET, Destination, SecretFilter, deliver_due, destinations, url_secrets
from .diskring import recover_ring, ring_state
from .messages import alert_text, recovery_text, replay_failed_text, verdict_text
from .outbox import Notification, Outbox, notification_id
from .replayer import ReplayOutcome, run_replay_subprocess
from .rundir import make_private_dir, parse_capture_name
from .runwatch import Active, RunWatch, load_progress, merge_verdicts, save_progress, transitions

__all__ = ["Daemon", "AlreadyRunning", "read_status", "daemon_pid"]

log = logging.getLogger("sentineld.daemon")

#: Seconds between signature evaluations of a run that wrote nothing new (for ``stalled``).
IDLE_EVAL_S = 10.0

#: Seconds one run may hold the main loop while catching up before the others get a turn.
CATCH_UP_SLICE_S = 0.5

#: Seconds between saves of a run's reading progress when nothing fired (an alert saves at once;
#: a restart re-reads at most this much, and the outbox ids make the re-read alert-free).
PROGRESS_EVERY_S = 1.0

#: Seconds a new run directory may lack its run.json before that is reported.
RUN_JSON_GRACE_S = 10.0

#: Seconds before a failed ring recovery is tried again.
RECOVER_RETRY_S = 60.0
#: Seconds a multi-rank run's new alert waits for the other ranks' streams (our measurement: DDP
#: ranks on one host flush their NaN step within ~0.3 s of each other).
RANK_GRACE_S = 2.0


def _active(d: dict[str, Any]) -> Active:
    return Active(**{k: v for k, v in d.items() if k in Active.__dataclass_fields__})


def _destination_secret(state_dir: Path) -> bytes:
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


class AlreadyRunning(Exception):
    """Another daemon holds this state dir's lock (the message gives its pid)."""


def daemon_pid(state_dir: Path) -> int | None:
    """Pid of the daemon holding ``state_dir``'s lock, or None when none runs (stale pidfile)."""
    lock = FileLock(str(state_dir / "daemon.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            return int((state_dir / "daemon.pid").read_text().strip())
        except (OSError, ValueError):
            return -1
    lock.release()
    return None


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The daemon's last ``status.json``, or None."""
    try:
        return json.loads((state_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None


class Daemon:
    """One daemon over ``config.runs_dir``. Use :meth:`run` (blocks until :meth:`stop`).

    Args:
        config: :class:`DaemonConfig`.
        clock: wall clock in seconds (injectable for tests of timing logic).
    """

    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.clock = clock
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.state_dir = make_private_dir(config.state_dir)
        self.outbox = Outbox(self.state_dir / "outbox")
        self.progress_dir = make_private_dir(self.state_dir / "progress")
        self.replays_dir = make_private_dir(self.state_dir / "replays")
        self.runs: dict[str, RunWatch] = {}
        self.replay_queue: queue.Queue[tuple[RunWatch, Path]] = queue.Queue()
        self.recover_queue: queue.Queue[tuple[RunWatch, Path]] = queue.Queue()
        self.started_s = clock()
        self.alerts_sent = 0
        self.alerts_suppressed = 0
        self.resent_in_doubt = 0
        self.replays_run = 0
        self.rings_recovered = 0
        self.delivery_failures = 0
        self.secrets = SecretFilter(set().union(*(url_secrets(u) for u in config.notify),
                                                url_secrets(config.alertmanager_url or "")))
        # Before anything parses the URLs: apprise logs them (unmasked tokens) at DEBUG.
        self._filtered = [h for h in logging.getLogger().handlers if self.secrets not in h.filters]
        for h in self._filtered:
            h.addFilter(self.secrets)
        self.dests: list[Destination] = destinations(config.notify, _destination_secret(self.state_dir))
        self._recovering: dict[str, float] = {}
        self._rings_checked: dict[str, float] = {}
        self._saved: dict[str, float] = {}
        self._unsaved: set[str] = set()
        self.metrics_port: int | None = None
        self._dirty: set[Path] = set()
        self._dirty_lock = threading.Lock()
        self._last_eval: dict[str, float] = {}
        self._sig_config = self._signature_config()
        self._am: Any = None
        self._metrics: dict[str, Any] = {}
        self._queued: set[str] = set()
        self._held: dict[tuple[str, str], float] = {}
        self._am_lock = threading.Lock()
        self._delivery_wake = threading.Event()

    # ------------------------------------------------------------------ setup
    def _signature_config(self) -> Any:
        from .signatures import SignatureConfig  # noqa: PLC0415

        return SignatureConfig.from_mapping(dict(self.cfg.signatures))

    def _start_metrics(self) -> Any:
        if self.cfg.metrics_port == 0:
            return None
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server  # noqa: PLC0415

        reg = CollectorRegistry()
        m = self._metrics
        m["runs"] = Gauge("sentineld_daemon_runs_watched", "Run directories watched", registry=reg)
        m["active"] = Gauge("sentineld_signature_active", "1 while a signature fires",
                            ["run", "signature", "severity"], registry=reg)
        m["sent"] = Counter("sentineld_alerts_sent", "Notifications delivered", ["signature"], registry=reg)
        m["failures"] = Counter("sentineld_alert_delivery_failures", "Failed delivery attempts", registry=reg)
        m["pending"] = Gauge("sentineld_alerts_pending", "Notifications not yet delivered", registry=reg)
        m["replays"] = Counter("sentineld_replays", "Replays finished", ["result"], registry=reg)
        for result in ("localized", "not_localized", "not_reproduced", "failed", "timeout"):
            m["replays"].labels(result)  # export 0 from the start so increase() sees the first one
        port = 0 if self.cfg.metrics_port == -1 else self.cfg.metrics_port
        try:
            server, _ = start_http_server(port, addr=self.cfg.metrics_addr, registry=reg)
        except OSError as exc:
            log.warning("daemon metrics off: cannot bind %s:%d (%s)", self.cfg.metrics_addr, port, exc)
            return None
        self.metrics_port = int(server.server_port)
        return server

    def _observer(self) -> Any:
        from watchdog.events import FileSystemEventHandler  # noqa: PLC0415
        from watchdog.observers import Observer  # noqa: PLC0415
        from watchdog.observers.polling import PollingObserver  # noqa: PLC0415

        daemon = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                for p in (getattr(event, "src_path", None), getattr(event, "dest_path", None)):
                    if p:
                        daemon._mark_dirty(Path(os.fsdecode(p)))

        obs = PollingObserver(timeout=self.cfg.poll_s) if self.cfg.polling_observer else Observer()
        obs.schedule(Handler(), str(self.cfg.runs_dir), recursive=True)
        obs.start()
        return obs

    def _mark_dirty(self, path: Path) -> None:
        if path.name.endswith(".tmp"):
            return
        try:
            rel = path.relative_to(self.cfg.runs_dir)
        except ValueError:
            return
        if rel.parts:
            with self._dirty_lock:
                self._dirty.add(self.cfg.runs_dir / rel.parts[0])
            self.wake.set()

    # -------------------------------------------------------------- lifetime
    def stop(self, *_: Any) -> None:
        """Ask every loop to finish (safe from a signal handler)."""
        self.stop_event.set()
        self.wake.set()

    def run(self, install_signals: bool = True) -> None:
        """Take the lock, start the threads and loop until :meth:`stop` or SIGTERM/SIGINT.

        Raises:
            AlreadyRunning: another daemon uses this state dir.
        """
        old_umask = os.umask(0o077)  # everything we create: dirs 0700, files 0600
        try:
            self._run(install_signals)
        finally:
            os.umask(old_umask)

    def _run(self, install_signals: bool) -> None:
        lock = FileLock(str(self.state_dir / "daemon.lock"), mode=0o600)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            pid = daemon_pid(self.state_dir)
            raise AlreadyRunning(f"a sentineld daemon (pid {pid}) already runs with state dir "
                                 f"{self.state_dir}; `sentineld stop` stops it") from None
        pidfile = self.state_dir / "daemon.pid"
        with ExitStack() as stack:
            stack.callback(lock.release)
            for h in logging.getLogger().handlers:
                if self.secrets not in h.filters:
                    h.addFilter(self.secrets)
                    self._filtered.append(h)
            for h in self._filtered:
                stack.callback(h.removeFilter, self.secrets)
            fd = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            stack.callback(lambda: pidfile.unlink(missing_ok=True))
            if install_signals and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self.stop)
                signal.signal(signal.SIGINT, self.stop)
            make_private_dir(self.cfg.runs_dir)
            server = self._start_metrics()
            if server is not None:
                stack.callback(server.server_close)
                stack.callback(server.shutdown)
            obs = self._observer()
            stack.callback(obs.join, 5)
            stack.callback(obs.stop)
            if self.cfg.alertmanager_url:
                from .alertmanager import ActiveAlerts  # noqa: PLC0415

                self._am = ActiveAlerts(resend_s=60.0)
            urls = ", ".join(d.shown for d in self.dests) or "none (notifications log only)"
            log.info("sentineld daemon %d watching %s; state %s; notify: %s", os.getpid(),
                     self.cfg.runs_dir, self.state_dir, urls)
            threads = [threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True)
                       for name, fn in (("delivery", self._delivery_loop), ("replay", self._replay_loop),
                                        ("recover", self._recover_loop))]
            for t in threads:
                t.start()
            self._guard(self._main_loop)
            for key in list(self._unsaved):
                if key in self.runs:
                    self._save(self.runs[key])
            self.stop_event.set()
            self.wake.set()
            for t in threads:
                t.join(timeout=10)
            self._write_status()
            log.info("sentineld daemon %d stopped", os.getpid())

    def _guard(self, fn: Callable[[], None]) -> None:
        while not self.stop_event.is_set():
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - a bug in one loop must not end the watch
                log.exception("daemon loop %s failed; restarting it in 1 s", fn.__name__)
                self.stop_event.wait(1.0)

    # ------------------------------------------------------------- main loop
    def _main_loop(self) -> None:
        last_scan = 0.0
        while not self.stop_event.is_set():
            now = self.clock()
            full = now - last_scan >= self.cfg.poll_s
            with self._dirty_lock:
                dirty, self._dirty = self._dirty, set()
            if full:
                last_scan = now
                dirty |= self._scan_runs_dir()
            for run_dir in sorted(dirty):
                self._process(run_dir)
            self._release_held()
            if full:
                self._idle_evaluations()
                self._write_status()
            self.wake.wait(min(self.cfg.poll_s, 0.5))
            self.wake.clear()

    def _scan_runs_dir(self) -> set[Path]:
        try:
            return {p for p in self.cfg.runs_dir.iterdir() if p.is_dir()}
        except OSError as exc:
            log.warning("cannot list runs dir %s: %s", self.cfg.runs_dir, exc)
            return set()

    def _watch(self, run_dir: Path) -> RunWatch:
        key = str(run_dir)
        rw = self.runs.get(key)
        if rw is None:
            rw = RunWatch(run_dir, window=self.cfg.window)
            saved = load_progress(self._progress_path(run_dir))
            if saved:
                rw.restore(saved)
                for k, act in rw.active.items():
                    if not act.get("notified", True):
                        self._held[(key, k)] = self.clock()  # held when the last daemon stopped
                if self._am is not None:
                    # Alertmanager forgets alerts that are not re-sent: restore what was firing.
                    for act in rw.active.values():
                        a = _active(act)
                        title, body = alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step,
                                                 a.message, a.numbers, a.fix, a.module)
                        self._am_fire(rw, a, title, body)
            self.runs[key] = rw
        return rw

    def _progress_path(self, run_dir: Path) -> Path:
        return self.progress_dir / f"{notification_id(str(run_dir))}.json"

    def _process(self, run_dir: Path) -> None:
        try:
            if not run_dir.is_dir():
                return
        except OSError:
            return
        rw = self._watch(run_dir)
        t0 = time.monotonic()
        changed = False
        while True:
            new, caps = rw.poll(max_records=max(1, self.cfg.window // 2))
            more = rw.behind
            if new:
                self._evaluate(rw, live=not more)
            for cap in caps:
                rw.captures_seen.add(cap.name)
                parsed = parse_capture_name(cap.name)
                if parsed is not None and parsed[2] == "crash":
                    self._crash_alert(rw, cap, parsed[0], parsed[1])
            changed |= bool(new or caps)
            if not more:
                break
            if time.monotonic() - t0 > CATCH_UP_SLICE_S:
                with self._dirty_lock:  # come back right after the other runs had a turn
                    self._dirty.add(run_dir)
                self.wake.set()
                break
        if rw.error and not self._young(run_dir, rw):
            if rw.error != rw.reported_error:
                log.warning("run %s: %s (still watching the other runs)", run_dir.name, rw.error)
                rw.reported_error = rw.error
        elif not rw.error and rw.reported_error:
            log.info("run %s: readable again", run_dir.name)
            rw.reported_error = None
        now = time.monotonic()
        if now - self._rings_checked.get(str(run_dir), 0.0) >= self.cfg.poll_s:
            self._rings_checked[str(run_dir)] = now
            self._check_rings(rw)
        if self.cfg.replay and rw.meta is not None:
            # Also after a restart: a capture seen before whose replay never finished runs again.
            for name in sorted(rw.captures_seen):
                cap = run_dir / name
                key = str(cap)
                if key not in self._queued and cap.exists() and not self._replay_record(rw, cap).exists():
                    self._queued.add(key)
                    self.replay_queue.put((rw, cap))
        if changed:
            self._unsaved.add(str(run_dir))
        if str(run_dir) in self._unsaved and now - self._saved.get(str(run_dir), 0.0) >= PROGRESS_EVERY_S:
            self._save(rw)

    def _save(self, rw: RunWatch) -> None:
        save_progress(self._progress_path(rw.run_dir), rw)
        self._unsaved.discard(str(rw.run_dir))
        self._saved[str(rw.run_dir)] = time.monotonic()

    def _young(self, run_dir: Path, rw: RunWatch) -> bool:
        """True for a run directory created moments ago whose run.json is not written yet."""
        if rw.meta is not None:
            return False
        try:
            return time.time() - run_dir.stat().st_mtime < RUN_JSON_GRACE_S
        except OSError:
            return False

    def _check_rings(self, rw: RunWatch) -> None:
        """Queue the recovery of on-disk rings whose training process is gone."""
        now = time.monotonic()
        for d in rw.ring_dirs():
            key = str(d)
            if now < self._recovering.get(key, 0.0) or ring_state(d) != "dead":
                continue
            try:
                host = json.loads((d / "meta.json").read_text()).get("host")
            except (OSError, ValueError, AttributeError):
                host = None
            self._recovering[key] = float("inf")
            if host and host != socket.gethostname():
                continue  # the daemon on its own host recovers it (flock is host-local)
            self.recover_queue.put((rw, d))

    def _idle_evaluations(self) -> None:
        now = self.clock()
        for rw in list(self.runs.values()):
            if rw.meta is None or not rw.tails or len(rw.ended) >= len(rw.tails):
                continue
            if now - self._last_eval.get(str(rw.run_dir), 0.0) >= IDLE_EVAL_S:
                self._evaluate(rw)

    def _evaluate(self, rw: RunWatch, live: bool = True) -> None:
        """Evaluate the signatures over ``rw``'s windows; ``live`` is False while catching up on
        old records (then ``stalled`` is not judged against the current time)."""
        from .signatures import evaluate  # noqa: PLC0415

        now = self.clock()
        self._last_eval[str(rw.run_dir)] = now
        per_rank = {}
        for rank, window in rw.records.items():
            if not window:
                continue
            now_s = None if (rank in rw.ended or not live) else now
            per_rank[rank] = evaluate(list(window), self._sig_config, now_s=now_s,
                                      num_classes=rw.meta.num_classes if rw.meta else None)
        if not per_rank:
            return
        current = merge_verdicts(per_rank)
        if any(a.signature == "nonfinite" for a in current.values()):
            # Once values are NaN/Inf every other detector reads garbage (a NaN layer is "dead"):
            # the non-finite alert and its replay say all there is to say.
            current = {k: a for k, a in current.items() if a.signature in ("nonfinite", "stalled")}
        fired, cleared = transitions(rw.active.keys(), current)
        for key, a in current.items():
            if key in rw.active:  # ranks that show a firing signature later join it
                ranks = rw.active[key]["ranks"]
                ranks.extend(r for r in a.ranks if r not in ranks)
        multi_rank = rw.meta is not None and rw.meta.world_size > 1
        for a in fired:
            last_s = rw.last_alert_s.get(a.key)
            if last_s is not None and now - last_s < self.cfg.alert_interval_s:
                # Rate limit: tracked (status, gauge, Alertmanager) but not notified, nor its recovery.
                rw.active[a.key] = {**asdict(a), "notified": True, "suppressed": True}
                self.alerts_suppressed += 1
                self._am_fire(rw, a, *alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step,
                                                 a.message, a.numbers, a.fix, a.module))
                log.info("run %s: %s fired again at step %d within %g s of its last alert: not "
                         "notified (alert_interval_s)", rw.run_id, a.key, a.step, self.cfg.alert_interval_s)
                continue
            rw.active[a.key] = asdict(a)
            if multi_rank:
                # Ranks of one job fail within moments of each other: wait briefly so the one
                # alert names every rank that showed it.
                self._held[(str(rw.run_dir), a.key)] = self.clock() + RANK_GRACE_S
            else:
                self._alert(rw, a)
        last = max(rw.last_step.values(), default=0)
        for key in cleared:
            d = rw.active.pop(key)
            a = _active(d)
            held = self._held.pop((str(rw.run_dir), key), None) is not None
            if d.get("suppressed"):
                self._am_resolve(rw, a)
            elif not held:
                self._recovery(rw, a, last)  # a held alert that cleared was never sent
        if fired or cleared:
            self._save(rw)
            self._update_active_gauge(rw)

    def _release_held(self) -> None:
        now = self.clock()
        for (run_key, key), deadline in list(self._held.items()):
            if now < deadline:
                continue
            del self._held[(run_key, key)]
            rw = self.runs.get(run_key)
            if rw is not None and key in rw.active:
                self._process(rw.run_dir)  # read what the other ranks wrote meanwhile
                if key in rw.active:
                    self._alert(rw, _active(rw.active[key]))

    def _update_active_gauge(self, rw: RunWatch) -> None:
        g = self._metrics.get("active")
        if g is None:
            return
        for sig, sev in _all_signatures():
            g.labels(rw.run_id, sig, sev).set(1 if any(
                a["signature"] == sig for a in rw.active.values()) else 0)

    # ------------------------------------------------------------ notifying
    def _targets(self) -> dict[str, str]:
        t = {LOG_TARGET: "pending"}
        t.update({d.key: "pending" for d in self.dests})
        return t

    def _enqueue(self, note: Notification) -> None:
        note.targets = self._targets()
        note.created_s = self.clock()
        if self.outbox.add(note):
            self.wake_delivery()

    def wake_delivery(self) -> None:
        """Let the delivery loop try now."""
        self._delivery_wake.set()

    def _alert(self, rw: RunWatch, a: Active) -> None:
        host = rw.meta.host if rw.meta else ""
        title, body = alert_text(rw.run_id, a.ranks, a.signature, a.severity, a.step, a.message,
                                 a.numbers, a.fix, a.module, host)
        nid = notification_id(rw.run_id, a.signature, a.module or "", a.step)
        # Outbox first (fsynced), then the progress that says it was sent: a crash in between
        # repeats the enqueue after the restart (same id: a no-op), never loses the alert.
        self._enqueue(Notification(id=nid, kind="alert", title=title, body=body, severity=a.severity,
                                   run=rw.run_id, signature=a.signature, step=a.step,
                                   data={"ranks": a.ranks, "numbers": a.numbers, "module": a.module}))
        rw.last_alert_s[a.key] = self.clock()
        if a.key in rw.active:
            rw.active[a.key]["notified"] = True
            self._save(rw)
        self._am_fire(rw, a, title, body)
        log.info("run %s: %s %s at step %d (ranks %s)", rw.run_id, a.severity, a.signature, a.step, a.ranks)

    def _crash_alert(self, rw: RunWatch, cap: Path, rank: int, step: int) -> None:
        """A training process died (exception, SIGTERM, SIGKILL with the disk ring): say so, with
        the exception, and how to replay the last steps it recorded."""
        from .capture import CaptureError, open_capture  # noqa: PLC0415

        try:
            with open_capture(cap) as c:
                reason = c.message or "no exception recorded"
        except CaptureError as exc:
            reason = f"(capture unreadable: {exc})"
        title = f"[sentineld] CRITICAL run {rw.run_id} crashed (rank {rank}) after step {step}"
        body = (f"The training process of run {rw.run_id} (rank {rank}) ended abnormally after step "
                f"{step}: {reason}\nIts last steps are in {cap.name}; the step that raised was never "
                f"completed, so replay the recorded ones: sentineld replay {rw.run_dir} --step {step}\n")
        self._enqueue(Notification(id=notification_id(rw.run_id, "crashed", cap.name), kind="alert",
                                   title=title, body=body, severity="critical", run=rw.run_id,
                                   signature="crashed", step=step, data={"rank": rank, "reason": reason}))
        log.info("run %s: crashed after step %d (rank %d): %s", rw.run_id, step, rank, reason)

    def _recovery(self, rw: RunWatch, a: Active, step: int) -> None:
        title, body = recovery_text(rw.run_id, a.signature, step, a.module)
        nid = notification_id(rw.run_id, a.signature, a.module or "", a.step, "recovered")
        self._enqueue(Notification(id=nid, kind="recovery", title=title, body=body, severity="info",
                                   run=rw.run_id, signature=a.signature, step=step))
        self._am_resolve(rw, a)

    def _am_resolve(self, rw: RunWatch, a: Active) -> None:
        if self._am is not None:
            from .alertmanager import alert_labels  # noqa: PLC0415

            with self._am_lock:
                self._am.resolve(alert_labels(a.signature, rw.run_id, a.severity, a.module))

    def _am_fire(self, rw: RunWatch, a: Active, title: str, body: str) -> None:
        if self._am is None:
            return
        from .alertmanager import to_am_alert  # noqa: PLC0415

        with self._am_lock:
            self._am.fire(to_am_alert(signature=a.signature, run=rw.run_id, severity=a.severity,
                                      summary=title, description=body, step=a.step, ranks=a.ranks,
                                      host=rw.meta.host if rw.meta else "", starts_at=self.clock(),
                                      module=a.module))

    def _delivery_loop(self) -> None:
        while not self.stop_event.is_set():
            res = deliver_due(self.outbox, self.dests, self.state_dir / "notifications.jsonl",
                              initial_s=self.cfg.retry_initial_s, max_s=self.cfg.retry_max_s,
                              clock=self.clock, scrub=self.secrets.scrub, stop=self.stop_event.is_set)
            sent, failed = res.delivered, res.failed
            self.resent_in_doubt += res.resent
            self.alerts_sent += sent
            self.delivery_failures += failed
            if self._metrics:
                if failed:
                    self._metrics["failures"].inc(failed)
                if sent:
                    self._metrics["sent"].labels("any").inc(sent)
                self._metrics["pending"].set(self.outbox.pending_count())
            if self._am is not None and self.cfg.alertmanager_url:
                from .alertmanager import flush  # noqa: PLC0415

                try:
                    with self._am_lock:
                        flush(self._am, self.cfg.alertmanager_url)
                except Exception as exc:  # noqa: BLE001 - retried on the next tick
                    log.warning("alertmanager forward failed (retrying): %s", exc)
            self._delivery_wake.wait(1.0)
            self._delivery_wake.clear()

    # --------------------------------------------------------------- replays
    def _replay_record(self, rw: RunWatch, cap: Path) -> Path:
        return self.replays_dir / f"{notification_id(rw.run_id, cap.name)}.json"

    def _replay_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                rw, cap = self.replay_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            record = self._replay_record(rw, cap)
            if record.exists() or rw.meta is None:
                continue
            log.info("run %s: replaying %s", rw.run_id, cap.name)
            try:
                outcome = run_replay_subprocess(rw.meta, rw.run_dir, cap, timeout_s=self.cfg.replay_timeout_s,
                                                memory_bytes=self.cfg.replay_memory_bytes,
                                                scratch_dir=self.replays_dir)
            except OSError as exc:  # the interpreter vanished, no fds left, ...
                outcome = ReplayOutcome("failed", None, f"cannot start the replay: {exc}", 0.0, None)
            if self.stop_event.is_set() and outcome.result in ("failed", "timeout"):
                self._queued.discard(str(cap))
                return  # cut short by our own shutdown: it runs again after a restart
            self._finish_replay(rw, cap, outcome, record)

    def _finish_replay(self, rw: RunWatch, cap: Path, outcome: ReplayOutcome, record: Path) -> None:
        self.replays_run += 1
        if self._metrics:
            self._metrics["replays"].labels(outcome.result).inc()
        nid = notification_id(rw.run_id, "replay", cap.name)
        if outcome.report is not None:
            title, body = verdict_text(outcome.report)
            sev = "critical" if outcome.report.get("phase") not in (None, "none") else "warning"
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity=sev,
                                run=rw.run_id, signature="replay", step=outcome.report.get("step"),
                                data=outcome.report)
        else:
            title, body = replay_failed_text(rw.run_id, cap.name, outcome.reason)
            note = Notification(id=nid, kind="verdict", title=title, body=body, severity="warning",
                                run=rw.run_id, signature="replay_failed",
                                data={"result": outcome.result, "reason": outcome.reason})
        self._enqueue(note)
        tmp = record.with_name(record.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"capture": str(cap), "result": outcome.result, "elapsed_s": outcome.elapsed_s,
                       "exit_code": outcome.exit_code, "reason": outcome.reason,
                       "report": outcome.report}, f, allow_nan=True)
        os.replace(tmp, record)
        log.info("run %s: replay %s -> %s in %.1f s", rw.run_id, cap.name, outcome.result, outcome.elapsed_s)

    # ------------------------------------------------------------- recovery
    def _recover_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                rw, ring = self.recover_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                cap = recover_ring(ring, who=f"the sentineld daemon (pid {os.getpid()})")
            except Exception as exc:  # noqa: BLE001 - a damaged ring must not stop the daemon
                log.warning("run %s: cannot turn the on-disk ring %s into a capture (retrying in "
                            "%g s): %s", rw.run_id, ring.name, RECOVER_RETRY_S, exc)
                self._recovering[str(ring)] = time.monotonic() + RECOVER_RETRY_S
                continue
            if cap is None and ring.exists():  # its writer holds the lock: look again later
                self._recovering[str(ring)] = time.monotonic() + 1.0
                continue
            if cap is not None:
                self.rings_recovered += 1
                log.info("run %s: a training process died without closing; crash capture %s "
                         "assembled from its on-disk ring", rw.run_id, cap.name)
                with self._dirty_lock:
                    self._dirty.add(rw.run_dir)
                self.wake.set()

    # --------------------------------------------------------------- status
    def _write_status(self) -> None:
        runs = []
        for rw in self.runs.values():
            runs.append({"run_id": rw.run_id, "run_dir": str(rw.run_dir), "ranks": sorted(rw.tails),
                         "last_step": max(rw.last_step.values(), default=None),
                         "ended": {str(k): v for k, v in rw.ended.items()},
                         "active": sorted(rw.active), "captures": len(rw.captures_seen),
                         "error": rw.error, "bad_lines": rw.bad_lines,
                         "agent_warnings": rw.agent_errors[-3:]})
        status = {"pid": os.getpid(), "host": socket.gethostname(), "started_s": self.started_s,
                  "updated_s": self.clock(), "runs_dir": str(self.cfg.runs_dir),
                  "runs_watched": len(self.runs), "alerts_sent": self.alerts_sent,
                  "delivery_failures": self.delivery_failures, "replays_run": self.replays_run,
                  "alerts_pending": self.outbox.pending_count(), "metrics_port": self.metrics_port,
                  "alerts_suppressed": self.alerts_suppressed, "resent_in_doubt": self.resent_in_doubt,
                  "rings_recovered": self.rings_recovered,
                  "notify": [d.shown for d in self.dests], "runs": runs}
        if self._metrics:
            self._metrics["runs"].set(len(self.runs))
        path = self.state_dir / "status.json"
        tmp = path.with_name("status.json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, path)


def _all_signatures() -> list[tuple[str, str]]:
    from .signatures.base import SIGNATURES  # noqa: PLC0415

    return list(SIGNATURES.items())
