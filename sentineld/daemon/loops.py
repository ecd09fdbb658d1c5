"""The daemon's background threads, each a loop that ends when the shared stop event is set
(watchdog's ``BaseThread`` pattern) and is restarted after a bug rather than ending the watch:

- :class:`DeliveryThread` sends due outbox notifications (retry with backoff; crash protocol in
  :mod:`sentineld.daemon.delivery`) and forwards to Alertmanager;
- :class:`ReplayThread` runs one replay subprocess at a time (timeout, memory limit) and hands
  its outcome on; for a run that localizes in process it first waits for the training process's
  own verdict (:mod:`sentineld.daemon.inprocess`);
- :class:`RecoverThread` turns the on-disk ring of a training process that died without closing
  into a ``crash`` capture (:mod:`sentineld.daemon.ring_recovery`).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sentineld.contracts.ringformat import MAX_RING_META_BYTES, META_FILE, RingMeta, ring_state
from sentineld.contracts.rundir import RunDir, RunMeta
from sentineld.contracts.safeio import read_regular
from sentineld.contracts.triggers import REPLICA_DIVERGENCE
from sentineld.daemon.am_incident import no_recipe_outcome, verdict_may_come
from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.delivery import SecretFilter, deliver_due
from sentineld.daemon.inprocess import InProcessVerdicts
from sentineld.daemon.metrics import DaemonMetrics
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.outbox import notification_id
from sentineld.daemon.replay_queue import FairQueue
from sentineld.daemon.replay_runner import ReplayOutcome, run_replay_subprocess
from sentineld.daemon.ring_recovery import recover_ring
from sentineld.daemon.runwatch import RunWatch
from sentineld.daemon.statedir import write_json_atomic
from sentineld.daemon.watcher import DirtyRuns

__all__ = ["Stats", "guard", "LoopThread", "DeliveryThread", "ReplayThread", "RecoverThread",
           "RECOVER_RETRY_S"]

log = logging.getLogger("sentineld.daemon")

#: Seconds before a failed ring recovery is tried again.
RECOVER_RETRY_S = 60.0


@dataclass
class Stats:
    """Counters shown in ``status.json`` (each written by one thread)."""

    alerts_sent: int = 0
    alerts_suppressed: int = 0
    resent_in_doubt: int = 0
    replays_run: int = 0
    rings_recovered: int = 0
    delivery_failures: int = 0
    stale_temps_removed: int = 0


def guard(fn: Callable[[], None], stop: threading.Event) -> None:
    """Run ``fn`` until it returns or ``stop`` is set; a bug restarts it after 1 s."""
    while not stop.is_set():
        try:
            fn()
            return
        except Exception:  # a bug in one loop must not end the watch
            log.exception("daemon loop %s failed; restarting it in 1 s", getattr(fn, "__name__", fn))
            stop.wait(1.0)


class LoopThread(threading.Thread):
    """A daemon thread running :meth:`loop` under :func:`guard` until ``stop`` is set."""

    def __init__(self, name: str, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.stop_event = stop

    def should_keep_running(self) -> bool:
        """False once the daemon is stopping."""
        return not self.stop_event.is_set()

    def run(self) -> None:
        guard(self.loop, self.stop_event)

    def loop(self) -> None:
        """The thread's body: loop while :meth:`should_keep_running`."""
        raise NotImplementedError


class DeliveryThread(LoopThread):
    """Deliver due notifications every second, or at once when woken."""

    def __init__(self, stop: threading.Event, cfg: DaemonConfig, notifier: Notifier, log_path: Path,
                 secrets: SecretFilter, stats: Stats, metrics: DaemonMetrics) -> None:
        super().__init__("delivery", stop)
        self.cfg, self.notifier, self.log_path = cfg, notifier, log_path
        self.secrets, self.stats, self.metrics = secrets, stats, metrics

    def loop(self) -> None:
        n = self.notifier
        while self.should_keep_running():
            res = deliver_due(n.outbox, n.dests, self.log_path, initial_s=self.cfg.retry_initial_s,
                              max_s=self.cfg.retry_max_s, clock=n.clock, scrub=self.secrets.scrub,
                              stop=self.stop_event.is_set)
            self.stats.resent_in_doubt += res.resent
            self.stats.alerts_sent += res.delivered
            self.stats.delivery_failures += res.failed
            self.metrics.delivered(res.failed, res.by_signature, n.outbox.pending_count)
            n.am_flush(self.cfg.alertmanager_url or "")
            n.delivery_wake.wait(1.0)
            n.delivery_wake.clear()


class ReplayThread(LoopThread):
    """Replay queued captures one at a time; each outcome is notified, counted, and kept as the
    capture's replay record in ``records_dir`` (its existence means "replayed").

    Args:
        records_dir: the state dir's ``replays/`` (also the replays' scratch dir).
    """

    def __init__(self, stop: threading.Event, cfg: DaemonConfig, records_dir: Path, notifier: Notifier,
                 stats: Stats, metrics: DaemonMetrics) -> None:
        super().__init__("replay", stop)
        self.cfg, self.scratch = cfg, records_dir
        self.notifier, self.stats, self.metrics = notifier, stats, metrics
        # round robin over runs: a run flooding captures delays another by one replay (replay_queue)
        self.jobs: FairQueue[tuple[RunWatch, Path]] = FairQueue()
        # Captures queued or running; one cut short by the daemon's own shutdown leaves it, to
        # run again after a restart.
        self.queued: set[str] = set()
        self.in_process = InProcessVerdicts(timeout_s=cfg.replay_timeout_s)

    def offer(self, rw: RunWatch) -> None:
        """Queue the captures of ``rw`` not replayed yet (also after a restart: a capture seen
        before whose replay never finished runs again)."""
        if rw.meta is None:
            return
        for name in sorted(rw.captures_seen):
            parsed = RunDir.parse_capture_name(name)
            if parsed is not None and parsed[2] == REPLICA_DIVERGENCE:
                # No fault to replay: the step ran clean on every rank, its replicas just differ
                # (the signature alerts from the stream); the capture is kept for `sentineld replay`.
                continue
            cap = rw.run_dir / name
            key = f"{rw.incident_scope}|{cap}"  # a new run reusing the path replays its own captures
            if key not in self.queued and cap.exists() and not self.record_of(rw, cap).exists():
                self.queued.add(key)
                self.jobs.put(str(rw.run_dir), (rw, cap))

    def loop(self) -> None:
        while self.should_keep_running():
            try:
                rw, cap = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            record = self.record_of(rw, cap)
            if record.exists() or rw.meta is None:
                continue
            if self._in_process_verdict(rw, rw.meta, cap, record):
                continue
            log.info("run %s: replaying %s", rw.run_id, cap.name)
            try:
                outcome = run_replay_subprocess(rw.meta, rw.run_dir, cap, timeout_s=self.cfg.replay_timeout_s,
                                                memory_bytes=self.cfg.replay_memory_bytes,
                                                scratch_dir=self.scratch, what_if=self.cfg.what_if)
            except OSError as exc:  # the interpreter vanished, no fds left, ...
                outcome = ReplayOutcome("failed", None, f"cannot start the replay: {exc}", 0.0, None)
            if self.stop_event.is_set() and outcome.result in ("failed", "timeout"):
                self.queued.discard(f"{rw.incident_scope}|{cap}")
                return  # cut short by our own shutdown: it runs again after a restart
            self.finish(rw, cap, outcome, record)

    def record_of(self, rw: RunWatch, cap: Path) -> Path:
        """The replay record of capture ``cap`` of ``rw``."""
        return self.scratch / f"{notification_id(rw.incident_scope, cap.name)}.json"

    def finish(self, rw: RunWatch, cap: Path, outcome: ReplayOutcome, record: Path) -> None:
        """Hand on the outcome of replaying ``cap``: notified, counted, recorded in ``record``."""
        if rw.meta is not None:  # always set here: the replay thread skips runs without run.json
            outcome = no_recipe_outcome(rw.run_id, rw.meta.recipe, outcome, verdict_may_come(rw.meta.extra))
        self.stats.replays_run += 1
        self.metrics.replay_finished(outcome.result)
        self.notifier.verdict(rw, cap, outcome)
        write_json_atomic(record, {"capture": str(cap), "result": outcome.result,
                                   "elapsed_s": outcome.elapsed_s, "exit_code": outcome.exit_code,
                                   "reason": outcome.reason, "report": outcome.report})
        # The reason goes to the log for every failure: one run pages "replay failed" once (the
        # notifier's id names no capture), the log keeps why each of its captures failed.
        log.info("run %s: replay %s -> %s in %.1f s%s", rw.run_id, cap.name, outcome.result, outcome.elapsed_s,
                 f": {outcome.reason[-500:]}" if outcome.result == "failed" and outcome.reason else "")

    def _in_process_verdict(self, rw: RunWatch, meta: RunMeta, cap: Path, record: Path) -> bool:
        """True when the training process's own verdict for ``cap`` was handed on, or is still
        awaited (``cap`` queued again); False: the daemon replays it itself."""
        decision, outcome = self.in_process.decide(meta, cap)
        if decision == "wait":
            time.sleep(0.05)
            self.jobs.put(str(rw.run_dir), (rw, cap))
            return True
        if outcome is not None:
            self.finish(rw, cap, outcome, record)
            return True
        return False


class RecoverThread(LoopThread):
    """Assemble crash captures from dead processes' on-disk rings; marks the run dirty after."""

    def __init__(self, stop: threading.Event, dirty: DirtyRuns, stats: Stats) -> None:
        super().__init__("recover", stop)
        self.dirty, self.stats = dirty, stats
        self.jobs: queue.Queue[tuple[RunWatch, Path]] = queue.Queue()
        # ring path -> monotonic time before which it is not looked at again
        self.retry_at: dict[str, float] = {}

    def offer(self, rw: RunWatch) -> None:
        """Queue the recovery of ``rw``'s on-disk rings whose training process is gone."""
        now = time.monotonic()
        for d in rw.ring_dirs():
            key = str(d)
            if now < self.retry_at.get(key, 0.0) or ring_state(d) != "dead":
                continue
            try:
                # the safe reader: a FIFO named meta.json must not block the main loop
                host = RingMeta.from_json(read_regular(d / META_FILE, MAX_RING_META_BYTES)).host
            except (OSError, ValueError):
                host = None
            self.retry_at[key] = float("inf")
            if host and host != socket.gethostname():
                continue  # the daemon on its own host recovers it (flock is host-local)
            self.jobs.put((rw, d))

    def loop(self) -> None:
        while self.should_keep_running():
            try:
                rw, ring = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                cap = recover_ring(ring, who=f"the sentineld daemon (pid {os.getpid()})")
            except Exception as exc:  # noqa: BLE001 - a damaged ring must not stop the daemon
                log.warning("run %s: cannot turn the on-disk ring %s into a capture (retrying in "
                            "%g s): %s", rw.run_id, ring.name, RECOVER_RETRY_S, exc)
                self.retry_at[str(ring)] = time.monotonic() + RECOVER_RETRY_S
                continue
            if cap is None and ring.exists():  # its writer holds the lock: look again later
                self.retry_at[str(ring)] = time.monotonic() + 1.0
                continue
            if cap is not None:
                self.stats.rings_recovered += 1
                log.info("run %s: a training process died without closing; crash capture %s "
                         "assembled from its on-disk ring", rw.run_id, cap.name)
                self.dirty.add(rw.run_dir)
