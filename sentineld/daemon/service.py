"""The daemon service: lock, watcher, main loop; watch run directories, alert on signatures,
deliver, and replay captures.

Threads, each waiting on the stop event with a timeout (never a bare sleep):

- main: on file events (watchdog) or every ``poll_s``, polls each run (:class:`RunWatch`),
  evaluates signatures over each rank's window (a stream that is behind is read in bounded
  chunks, each evaluated), enqueues alerts and recovery notices in the outbox, queues replays
  for new captures and recoveries for on-disk rings of dead processes, and writes
  ``status.json``;
- delivery, replay, recover: :mod:`sentineld.daemon.loops` (one thread each).

What to alert on is decided by :mod:`sentineld.daemon.policy` (pure) and carried out by
:mod:`sentineld.daemon.alerting`; what is said and where it
goes by :mod:`sentineld.daemon.notifier`.

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

import logging
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.rundir import RunDirError, make_private_dir, parse_capture_name, runs_dir_problem
from sentineld.contracts.triggers import CRASH
from sentineld.daemon.alerting import Alerting
from sentineld.daemon.am_incident import no_recipe_outcome, verdict_may_come
from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.delivery import SecretFilter, destinations, url_secrets
from sentineld.daemon.loops import DeliveryThread, RecoverThread, ReplayThread, Stats, guard
from sentineld.daemon.metrics import start_metrics
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import Outbox, notification_id
from sentineld.daemon.policy import active_from_dict
from sentineld.daemon.replay_runner import ReplayOutcome
from sentineld.daemon.runwatch import RunWatch, load_progress, remove_stale_temps, same_run, save_progress
from sentineld.daemon.statedir import (
    AM_EXTRAS,
    destination_secret,
    private_state_dir,
    take_lock,
    write_json_atomic,
    write_pidfile,
    write_status,
)
from sentineld.daemon.watcher import DirtyRuns, start_observer

__all__ = ["Daemon"]

log = logging.getLogger("sentineld.daemon")


#: Seconds one run may hold the main loop while catching up before the others get a turn.
CATCH_UP_SLICE_S = 0.5

#: Seconds between saves of a run's reading progress when nothing fired (an alert saves at once;
#: a restart re-reads at most this much, and the outbox ids make the re-read alert-free).
PROGRESS_EVERY_S = 1.0

#: Seconds a new run directory may lack its run.json before that is reported.
RUN_JSON_GRACE_S = 10.0



class Daemon(Alerting):
    """One daemon over ``config.runs_dir``. Use :meth:`run` (blocks until :meth:`stop`).

    Args:
        config: :class:`DaemonConfig`.
        clock: wall clock in seconds (injectable for tests of timing logic).
    """

    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.clock = clock
        self.stop_event = threading.Event()
        self.dirty = DirtyRuns(config.runs_dir)
        self.state_dir = private_state_dir(config.state_dir)  # ours, writable by no one else
        self.progress_dir = make_private_dir(self.state_dir / "progress")
        self.replays_dir = make_private_dir(self.state_dir / "replays")
        self.runs: dict[str, RunWatch] = {}
        self.started_s = clock()
        self.stats = Stats()
        self.secrets = SecretFilter(set().union(*(url_secrets(u) for u in config.notify),
                                                url_secrets(config.alertmanager_url or "")))
        # Before anything parses the URLs: apprise logs them (unmasked tokens) at DEBUG.
        self._filtered = [h for h in logging.getLogger().handlers if self.secrets not in h.filters]
        for h in self._filtered:
            h.addFilter(self.secrets)
        self.notifier = Notifier(Outbox(self.state_dir / "outbox"),
                                 destinations(config.notify, destination_secret(self.state_dir)), clock,
                                 replay_enabled=config.replay, extras_path=self.state_dir / AM_EXTRAS,
                                 host=config.host)
        self.metrics_port: int | None = None
        self._metrics: dict[str, Any] = {}
        self._rings_checked: dict[str, float] = {}
        self._saved: dict[str, float] = {}
        self._unsaved: set[str] = set()
        self._last_eval: dict[str, float] = {}
        self._sig_config = self._signature_config()
        self._held: dict[tuple[str, str], float] = {}
        self._run_failures: dict[str, str] = {}  # run dir -> last error logged for it
        self.stale_temps_removed = 0

    @property
    def wake(self) -> threading.Event:
        """Set to make the main loop look at the runs now."""
        return self.dirty.wake

    def _signature_config(self) -> Any:
        from sentineld.signatures import SignatureConfig  # noqa: PLC0415

        return SignatureConfig.from_mapping(dict(self.cfg.signatures))

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
            lock = take_lock(self.state_dir)
            with ExitStack() as stack:
                stack.callback(lock.release)
                self._start(stack, install_signals)
                self._serve()
        finally:
            os.umask(old_umask)

    def _start(self, stack: ExitStack, install_signals: bool) -> None:
        """Everything the threads need, each undone by ``stack`` at exit."""
        for h in logging.getLogger().handlers:
            if self.secrets not in h.filters:
                h.addFilter(self.secrets)
                self._filtered.append(h)
        for h in self._filtered:
            stack.callback(h.removeFilter, self.secrets)
        pidfile = write_pidfile(self.state_dir)
        stack.callback(lambda: pidfile.unlink(missing_ok=True))
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        make_private_dir(self.cfg.runs_dir)  # 0700 if we create it; an existing one keeps its mode
        if (problem := runs_dir_problem(self.cfg.runs_dir)) is not None:
            raise RunDirError(problem)  # a shared dir we cannot trust: refused, saying what to do
        server, self._metrics, self.metrics_port = start_metrics(self.cfg.metrics_port, self.cfg.metrics_addr)
        if server is not None:
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        obs = start_observer(self.dirty, self.cfg.polling_observer, self.cfg.poll_s)
        stack.callback(obs.join, 5)
        stack.callback(obs.stop)
        if self.cfg.alertmanager_url:
            from sentineld.daemon.alertmanager import DAEMON_HOLD_S  # noqa: PLC0415
            from sentineld.daemon.am_active import ActiveAlerts  # noqa: PLC0415

            # Held 24 h past each re-send: a stopped daemon does not resolve an incident (issue 16).
            self.notifier.am = ActiveAlerts(resend_s=60.0, hold_s=DAEMON_HOLD_S)
            self.notifier.restore_extras()  # verdicts, crashes; progress restores the rest
        urls = ", ".join(d.shown for d in self.notifier.dests) or "none (notifications log only)"
        log.info("sentineld daemon %d watching %s; state %s; notify: %s", os.getpid(),
                 self.cfg.runs_dir, self.state_dir, urls)

    def _serve(self) -> None:
        """Run the threads and the main loop until stopped; save what is unsaved."""
        self._replayer = ReplayThread(self.stop_event, self.cfg, self.replays_dir, self._replay_record,
                                      self._finish_replay)
        self._recoverer = RecoverThread(self.stop_event, self.dirty, self.stats)
        threads = [DeliveryThread(self.stop_event, self.cfg, self.notifier, self.state_dir / "notifications.jsonl",
                                  self.secrets, self.stats, self._metrics), self._replayer, self._recoverer]
        for t in threads:
            t.start()
        guard(self._main_loop, self.stop_event)
        for key in list(self._unsaved):
            if key in self.runs:
                self._save(self.runs[key])
        self.stop_event.set()
        self.wake.set()
        for t in threads:
            t.join(timeout=10)
        self._write_status()
        log.info("sentineld daemon %d stopped", os.getpid())

    # ------------------------------------------------------------- main loop
    def _main_loop(self) -> None:
        last_scan = 0.0
        while not self.stop_event.is_set():
            now = self.clock()
            full = now - last_scan >= self.cfg.poll_s
            dirty = self.dirty.take()
            if full:
                last_scan = now
                dirty |= self._scan_runs_dir()
            self.notifier.retry_unwritten()
            for run_dir in sorted(dirty):
                self._process_isolated(run_dir)
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
            if saved and not same_run(run_dir, saved):
                log.info("run dir %s holds a new run since the last daemon; watching it from the start", run_dir)
                saved = None
            if saved:
                rw.restore(saved)
                for k, act in rw.active.items():
                    if not act.get("notified", True):
                        self._held[(key, k)] = self.clock()  # held when the last daemon stopped
                    # Alertmanager forgets alerts that are not re-sent: restore what was firing.
                    self.notifier.am_fire_quietly(rw, active_from_dict(act))
            self.runs[key] = rw
        return rw

    def _forget(self, key: str) -> None:
        """Drop what is known of the run at path ``key`` (a new run replaced it)."""
        self.runs.pop(key, None)
        self._unsaved.discard(key)
        self._saved.pop(key, None)
        self._rings_checked.pop(key, None)
        for held in [h for h in self._held if h[0] == key]:
            del self._held[held]
        self._progress_path(Path(key)).unlink(missing_ok=True)

    def _progress_path(self, run_dir: Path) -> Path:
        return self.progress_dir / f"{notification_id(str(run_dir))}.json"

    def _process_isolated(self, run_dir: Path) -> None:
        """:meth:`_process` one run; whatever goes wrong there stays with that run (its status
        shows it) and the loop goes on to the others."""
        try:
            self._process(run_dir)
        except Exception as exc:  # noqa: BLE001 - a run dir another process wrote can hold anything
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
            rw = self.runs.get(str(run_dir))
            if rw is not None:
                rw.error = f"cannot process this run: {why}"
            if self._run_failures.get(str(run_dir)) != why:
                self._run_failures[str(run_dir)] = why
                log.warning("run %s: %s (still watching the other runs)", run_dir.name, why,
                            exc_info=not isinstance(exc, (OSError, RecursionError, ValueError)))

    def _process(self, run_dir: Path) -> None:
        try:
            if not run_dir.is_dir():
                return
        except OSError:
            return
        rw = self._watch(run_dir)
        changed = self._read_run(rw)
        if rw.replaced:  # the directory was deleted or moved and a new run took its path
            log.info("run dir %s holds a new run; watching it from the start", run_dir)
            self._forget(str(run_dir))
            rw = self._watch(run_dir)
            changed = self._read_run(rw) or True
        self._report_error(rw)
        now = time.monotonic()
        if now - self._rings_checked.get(str(run_dir), 0.0) >= self.cfg.poll_s:
            self._rings_checked[str(run_dir)] = now
            self._recoverer.offer(rw)
            self.stale_temps_removed += remove_stale_temps(rw)  # counted in status
        if self.cfg.replay:
            self._replayer.offer(rw)
        if changed:
            self._unsaved.add(str(run_dir))
        if str(run_dir) in self._unsaved and now - self._saved.get(str(run_dir), 0.0) >= PROGRESS_EVERY_S:
            self._save(rw)

    def _read_run(self, rw: RunWatch) -> bool:
        """Read what ``rw`` wrote, a bounded slice at a time, evaluating each; True if anything."""
        t0 = time.monotonic()
        changed = False
        while True:
            new, caps = rw.poll(max_records=max(1, self.cfg.window // 2))
            more = rw.behind
            # An ended run with signatures still active is evaluated once more to close them
            # (its end record may come in a read of its own, with no step record).
            if new or (rw.active and not more and rw.all_ended):
                self._evaluate(rw, live=not more)
            if rw.notices:
                self.notifier.agent_notices(rw)
            for cap in caps:
                rw.captures_seen.add(cap.name)
                parsed = parse_capture_name(cap.name)
                if parsed is not None and parsed[2] == CRASH:
                    self.notifier.crash_alert(rw, cap, parsed[0], parsed[1])
            changed |= bool(new or caps)
            if not more:
                return changed
            if time.monotonic() - t0 > CATCH_UP_SLICE_S:
                self.dirty.add(rw.run_dir)  # come back right after the other runs had a turn
                return changed

    def _report_error(self, rw: RunWatch) -> None:
        if rw.error and not self._young(rw.run_dir, rw):
            if rw.error != rw.reported_error:
                log.warning("run %s: %s (still watching the other runs)", rw.run_dir.name, rw.error)
                rw.reported_error = rw.error
        elif not rw.error and rw.reported_error:
            log.info("run %s: readable again", rw.run_dir.name)
            rw.reported_error = None

    def _save(self, rw: RunWatch) -> None:
        try:
            save_progress(self._progress_path(rw.run_dir), rw)
        except OSError as exc:  # disk full: kept in memory, saved on a later turn
            self.notifier.write_error = f"progress of {rw.run_dir.name}: {exc}"
            return
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

    def wake_delivery(self) -> None:
        """Let the delivery thread try now."""
        self.notifier.delivery_wake.set()

    # --------------------------------------------------------------- replays
    def _replay_record(self, rw: RunWatch, cap: Path) -> Path:
        return self.replays_dir / f"{notification_id(rw.incident_scope, cap.name)}.json"

    def _finish_replay(self, rw: RunWatch, cap: Path, outcome: ReplayOutcome, record: Path) -> None:
        if rw.meta is not None:  # always set here: the replay thread skips runs without run.json
            outcome = no_recipe_outcome(rw.run_id, rw.meta.recipe, outcome, verdict_may_come(rw.meta.extra))
        self.stats.replays_run += 1
        if self._metrics:
            self._metrics["replays"].labels(outcome.result).inc()
        self.notifier.verdict(rw, cap, outcome)
        write_json_atomic(record, {"capture": str(cap), "result": outcome.result,
                                   "elapsed_s": outcome.elapsed_s, "exit_code": outcome.exit_code,
                                   "reason": outcome.reason, "report": outcome.report})
        log.info("run %s: replay %s -> %s in %.1f s", rw.run_id, cap.name, outcome.result, outcome.elapsed_s)

    # --------------------------------------------------------------- status
    def _write_status(self) -> None:
        st = self.stats
        status = {"pid": os.getpid(), "host": socket.gethostname(), "started_s": self.started_s,
                  "updated_s": self.clock(), "runs_dir": str(self.cfg.runs_dir),
                  "runs_watched": len(self.runs), "alerts_sent": st.alerts_sent,
                  "delivery_failures": st.delivery_failures, "replays_run": st.replays_run,
                  "alerts_pending": self.notifier.outbox.pending_count(), "metrics_port": self.metrics_port,
                  "alerts_suppressed": st.alerts_suppressed, "resent_in_doubt": st.resent_in_doubt,
                  "rings_recovered": st.rings_recovered, "notify": [d.shown for d in self.notifier.dests],
                  "alerts_unwritten": len(self.notifier.unwritten), "state_write_error": self.notifier.write_error,
                  "stale_temps_removed": self.stale_temps_removed,
                  "verdicts_ignored": self._replayer.in_process.ignored.count,  # not from their run
                  "runs": [rw.status() for rw in self.runs.values()]}
        if self._metrics:
            self._metrics["runs"].set(len(self.runs))
            for rw in self.runs.values():
                self._metrics["watched"].labels(rw.run_id).set(1)
        try:
            write_status(self.state_dir, status)
        except OSError as exc:  # disk full: the loop goes on; status is written once there is room
            if self.notifier.write_error is None:
                log.error("cannot write status.json: %s", exc)
            self.notifier.write_error = f"status.json: {exc}"

