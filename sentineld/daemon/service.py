"""The daemon service: lock, watcher, main loop; watch run directories, alert on signatures,
deliver, and replay captures.

Threads, each waiting on the stop event with a timeout (never a bare sleep):

- main: on file events (watchdog) or every ``poll_s``, polls each run (:class:`RunWatch`),
  evaluates signatures over each rank's window (a stream that is behind is read in bounded
  chunks, each evaluated), enqueues alerts and recovery notices in the outbox, queues replays
  for new captures and recoveries for on-disk rings of dead processes, and writes
  ``status.json``;
- delivery, replay, recover: :mod:`sentineld.daemon.loops` (one thread each).

The service owns one :class:`~sentineld.daemon.runstate.RunState` per run path and calls its
collaborators: :class:`~sentineld.daemon.alerting.Alerting` evaluates and carries out what
:mod:`sentineld.daemon.policy` (pure) decides, the :class:`~sentineld.daemon.notifier.Notifier`
says it and sends it on, :class:`~sentineld.daemon.metrics.DaemonMetrics` counts it.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from sentineld.contracts.rundir import RunDirError, make_private_dir, runs_dir_problem
from sentineld.daemon.alerting import Alerting
from sentineld.daemon.am_active import daemon_alerts
from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.delivery import SecretFilter, destinations, url_secrets
from sentineld.daemon.loops import DeliveryThread, RecoverThread, ReplayThread, Stats, guard
from sentineld.daemon.metrics import daemon_metrics
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import Outbox
from sentineld.daemon.runstate import ProgressStore, RunState
from sentineld.daemon.runwatch import RunWatch, remove_stale_temps
from sentineld.daemon.statedir import (
    AM_EXTRAS,
    destination_secret,
    private_state_dir,
    take_lock,
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

#: Seconds a new run directory may lack its run.json before its error is logged.
RUN_JSON_GRACE_S = 10.0


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
        self.dirty = DirtyRuns(config.runs_dir)
        self.state_dir = private_state_dir(config.state_dir)  # ours, writable by no one else
        self.progress = ProgressStore(make_private_dir(self.state_dir / "progress"))
        self.replays_dir = make_private_dir(self.state_dir / "replays")
        self.runs: dict[str, RunState] = {}
        self.started_s = clock()
        self.stats = Stats()
        self.secrets = SecretFilter(set().union(*(url_secrets(u) for u in config.notify),
                                                url_secrets(config.alertmanager_url or "")))
        self.secrets.install()  # before anything parses the URLs: apprise logs them (unmasked) at DEBUG
        self.notifier = Notifier(Outbox(self.state_dir / "outbox"),
                                 destinations(config.notify, destination_secret(self.state_dir)), clock,
                                 daemon_alerts(config.alertmanager_url), replay_enabled=config.replay,
                                 extras_path=self.state_dir / AM_EXTRAS, host=config.host)
        self.metrics = daemon_metrics(config.metrics_port)
        self.metrics_port: int | None = None
        self.alerting = Alerting(config, self.notifier, self.stats, save=self._save, metrics=self.metrics,
                                 clock=clock)
        self._replayer = ReplayThread(self.stop_event, config, self.replays_dir, self.notifier, self.stats,
                                      self.metrics)
        self._recoverer = RecoverThread(self.stop_event, self.dirty, self.stats)

    @property
    def wake(self) -> threading.Event:
        """Set to make the main loop look at the runs now."""
        return self.dirty.wake

    # -------------------------------------------------------------- lifetime
    def stop(self, *_: Any) -> None:
        """Ask every loop to finish (safe from a signal handler)."""
        self.stop_event.set()
        self.wake.set()
        # The delivery thread sleeps up to 1 s between rounds: woken, it sees the stop at once
        # (a stopping daemon took ~0.7 s on 2 cores, most of it that sleep; issue 23).
        self.notifier.delivery_wake.set()

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
        self.secrets.install()
        stack.callback(self.secrets.uninstall)
        pidfile = write_pidfile(self.state_dir)
        stack.callback(lambda: pidfile.unlink(missing_ok=True))
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        make_private_dir(self.cfg.runs_dir)  # 0700 if we create it; an existing one keeps its mode
        if (problem := runs_dir_problem(self.cfg.runs_dir)) is not None:
            raise RunDirError(problem)  # a shared dir we cannot trust: refused, saying what to do
        server, self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr)
        if server is not None:
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        obs = start_observer(self.dirty, self.cfg.polling_observer, self.cfg.poll_s)
        stack.callback(obs.join, 5)
        stack.callback(obs.stop)
        self.notifier.restore_extras()  # verdicts, crashes; progress restores the rest
        urls = ", ".join(d.shown for d in self.notifier.dests) or "none (notifications log only)"
        log.info("sentineld daemon %d watching %s; state %s; notify: %s", os.getpid(),
                 self.cfg.runs_dir, self.state_dir, urls)

    def _serve(self) -> None:
        """Run the threads and the main loop until stopped; save what is unsaved."""
        threads = [DeliveryThread(self.stop_event, self.cfg, self.notifier, self.state_dir / "notifications.jsonl",
                                  self.secrets, self.stats, self.metrics), self._replayer, self._recoverer]
        for t in threads:
            t.start()
        guard(self._main_loop, self.stop_event)
        for state in list(self.runs.values()):
            if state.unsaved:
                self._save(state)
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
                dirty |= self.dirty.scan()
            self.notifier.retry_unwritten()
            for run_dir in sorted(dirty):
                self._process_isolated(run_dir)
            for state, keys in self.alerting.due(self.runs.values()):
                self._process(state.run_dir)  # read what the other ranks wrote meanwhile
                self.alerting.release(state, keys)
            if full:
                self.alerting.evaluate_idle(self.runs.values())
                self._write_status()
            self.wake.wait(min(self.cfg.poll_s, 0.5))
            self.wake.clear()

    def _state(self, run_dir: Path) -> RunState:
        """The run at ``run_dir``, resumed from its saved progress when first seen."""
        state = self.runs.get(str(run_dir))
        if state is None:
            state = self.runs[str(run_dir)] = RunState(RunWatch(run_dir, window=self.cfg.window))
            saved = self.progress.load(run_dir)
            if saved:
                state.watch.restore(saved)  # a damaged progress file raises: logged with the run
                self.alerting.restored(state)
        return state

    def _forget(self, run_dir: Path) -> None:
        """Drop what is known of the run at ``run_dir`` (a new run replaced it)."""
        self.runs.pop(str(run_dir), None)
        self.progress.drop(run_dir)

    def _process_isolated(self, run_dir: Path) -> None:
        """:meth:`_process` one run; whatever goes wrong there stays with that run (its status
        shows it) and the loop goes on to the others."""
        try:
            self._process(run_dir)
        except Exception as exc:  # a run dir another process wrote can hold anything
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
            state = self._state(run_dir)
            state.watch.error = f"cannot process this run: {why}"
            if state.failure != why:
                state.failure = why
                log.warning("run %s: %s (still watching the other runs)", run_dir.name, why,
                            exc_info=not isinstance(exc, (OSError, RecursionError, ValueError)))

    def _process(self, run_dir: Path) -> None:
        try:
            if not run_dir.is_dir() or run_dir.is_symlink():  # a link is no run dir (DirtyRuns.scan)
                return
        except OSError:
            return
        state = self._state(run_dir)
        changed = self._read_run(state)
        if state.watch.replaced:  # the directory was deleted or moved and a new run took its path
            log.info("run dir %s holds a new run; watching it from the start", run_dir)
            self._forget(run_dir)
            state = self._state(run_dir)
            changed = self._read_run(state) or True
        state.watch.log_error_change(RUN_JSON_GRACE_S)
        now = time.monotonic()
        if now - state.rings_checked_s >= self.cfg.poll_s:
            state.rings_checked_s = now
            self._recoverer.offer(state.watch)
            self.stats.stale_temps_removed += remove_stale_temps(state.watch)  # counted in status
        if self.cfg.replay:
            self._replayer.offer(state.watch)
        state.unsaved |= changed
        if state.unsaved and now - state.saved_s >= PROGRESS_EVERY_S:
            self._save(state)

    def _read_run(self, state: RunState) -> bool:
        """Read what the run wrote, a bounded slice at a time, evaluating each; True if anything."""
        rw = state.watch
        t0 = time.monotonic()
        changed = False
        while True:
            new, caps = rw.poll(max_records=max(1, self.cfg.window // 2))
            more = rw.behind
            # An ended run with signatures still active is evaluated once more to close them
            # (its end record may come in a read of its own, with no step record).
            if new or (rw.active and not more and rw.all_ended):
                self.alerting.evaluate(state, live=not more)
            if rw.notices:
                self.notifier.agent_notices(rw)
            self.notifier.crashes(rw, caps)
            changed |= bool(new or caps)
            if not more:
                return changed
            if time.monotonic() - t0 > CATCH_UP_SLICE_S:
                self.dirty.add(rw.run_dir)  # come back right after the other runs had a turn
                return changed

    def _save(self, state: RunState) -> None:
        try:
            self.progress.save(state, time.monotonic())
        except OSError as exc:  # disk full: kept in memory, saved on a later turn
            self.notifier.state_write_failed(f"progress of {state.run_dir.name}: {exc}")

    # --------------------------------------------------------------- status
    def _write_status(self) -> None:
        n = self.notifier
        status = {"pid": os.getpid(), "host": socket.gethostname(), "started_s": self.started_s,
                  "updated_s": self.clock(), "runs_dir": str(self.cfg.runs_dir), "metrics_port": self.metrics_port,
                  "runs_watched": len(self.runs), **asdict(self.stats), **n.status(),
                  "verdicts_ignored": self._replayer.in_process.ignored.count,  # not from their run
                  "runs": [s.watch.status() for s in self.runs.values()]}
        self.metrics.watching(s.watch.run_id for s in self.runs.values())
        try:
            write_status(self.state_dir, status)
        except OSError as exc:  # disk full: the loop goes on; status is written once there is room
            if n.write_error is None:
                log.error("cannot write status.json: %s", exc)
            n.state_write_failed(f"status.json: {exc}")
