"""The daemon's alerting: evaluate a run's signatures, carry out the policy's decision.

What to alert on is decided by :func:`sentineld.daemon.policy.decide` (pure); :class:`Alerting`
feeds it a run's windows and does what it decided: notifications through the
:class:`~sentineld.daemon.notifier.Notifier`, holds for multi-rank runs, the run's saved
progress (through ``save``) and the active-signature gauge. The service calls it; it calls
nothing of the service::

    alerting = Alerting(cfg, notifier, stats, save=save_progress_of)
    alerting.evaluate(state)              # after new records were read
    for state, keys in alerting.due(states):
        ...                               # read what the other ranks wrote meanwhile
        alerting.release(state, keys)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.loops import Stats
from sentineld.daemon.metrics import DaemonMetrics
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.policy import Active, Decision, active_from_dict, decide, due_holds
from sentineld.daemon.runstate import RunState

__all__ = ["Alerting", "IDLE_EVAL_S", "RANK_GRACE_S", "MIN_FIRING_S"]

log = logging.getLogger("sentineld.daemon")

#: Seconds between signature evaluations of a run that wrote nothing new (for ``stalled``).
IDLE_EVAL_S = 10.0

#: Seconds a multi-rank run's new alert waits for the other ranks' streams (our measurement: DDP
#: ranks on one host flush their NaN step within ~0.3 s of each other).
RANK_GRACE_S = 2.0

#: The shortest a notified alert stays active: longer than the shipped Alertmanager
#: ``group_wait`` for pages (10 s, deploy/alertmanager/alertmanager.yml), so an incident that is
#: over within seconds is still paged, then resolved.
MIN_FIRING_S = 15.0


class Alerting:
    """Signature evaluation and alerting over runs the caller watches.

    Args:
        cfg: the daemon's config (``signatures``, ``alert_interval_s``).
        notifier: where alerts, recoveries and Alertmanager updates go.
        stats: the counters of ``status.json`` (``alerts_suppressed``).
        save: saves a run's progress; called after its outbox entry is written, so a crash in
            between repeats the enqueue (a no-op), never loses the alert.
        metrics: the daemon's metrics (the active-signature gauge); no-op by default.
        clock: wall clock, seconds.
    """

    def __init__(self, cfg: DaemonConfig, notifier: Notifier, stats: Stats, *, save: Callable[[RunState], None],
                 metrics: DaemonMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        from sentineld.signatures import SignatureConfig  # noqa: PLC0415 - loaded with the daemon, not the CLI

        self.cfg, self.notifier, self.stats, self.save = cfg, notifier, stats, save
        self.metrics = metrics or DaemonMetrics()
        self.clock = clock
        self.sig_config = SignatureConfig.from_mapping(dict(cfg.signatures))

    def restored(self, state: RunState) -> None:
        """A run's progress was restored at start: what was held when the last daemon stopped is
        held again (sent at the next release), and what was firing fires again in Alertmanager,
        which forgets alerts that are not re-sent."""
        for key, act in state.watch.active.items():
            if not act.get("notified", True):
                state.held[key] = self.clock()
            self.notifier.am_fire_quietly(state.watch, active_from_dict(act))

    def evaluate(self, state: RunState, live: bool = True) -> None:
        """Evaluate the signatures over the run's windows and carry out the policy's decision;
        ``live`` is False while catching up on old records (then ``stalled`` is not judged
        against the current time)."""
        from sentineld.signatures import evaluate, unresolved  # noqa: PLC0415

        rw = state.watch
        sig_config = self.run_config(state)
        now = self.clock()
        state.last_eval_s = now
        per_rank = {}
        for rank, rk in rw.ranks.items():
            if not rk.records:
                continue
            now_s = None if (rk.ended is not None or not live) else now
            new, rk.unjudged = rk.unjudged, 0  # every record read is judged once (issue 21)
            per_rank[rank] = evaluate(list(rk.records), sig_config, now_s=now_s,
                                      num_classes=rw.meta.num_classes if rw.meta else None, new=new)
        if not per_rank:
            return
        holding = unresolved(rw.active, {r: list(rk.records) for r, rk in rw.ranks.items() if rk.records},  # issue 21
                             sig_config, rw.meta.num_classes if rw.meta else None) if rw.active else set()
        d = decide(rw.active, per_rank, now_s=now, last_alert_s=rw.last_alert_s, holding=holding, held=list(state.held),
                   multi_rank=rw.meta is not None and rw.meta.world_size > 1,
                   alert_interval_s=self.cfg.alert_interval_s, rank_grace_s=RANK_GRACE_S,
                   ended=rw.all_ended, min_firing_s=MIN_FIRING_S)
        rw.active = d.active
        self.act(state, d)

    def run_config(self, state: RunState) -> Any:
        """The :class:`~sentineld.signatures.SignatureConfig` the run is judged with: the daemon's,
        with the run's own overrides from its run.json (``attach(..., signatures=...)``) merged
        once per read of that file. What of them is refused (a hand-edited run.json) is logged
        once, naming the run and the setting, and shown in the run's status entry
        (``signature_overrides_refused``, ``sentineld status``); the rest is applied."""
        from sentineld.signatures import merge_run_overrides  # noqa: PLC0415

        rw = state.watch
        if state.sig_config is not None and state.sig_config[0] is rw.meta:
            return state.sig_config[1]
        cfg, problems = merge_run_overrides(self.sig_config, rw.meta.extra if rw.meta else None)
        if problems != rw.override_problems:
            for p in problems:
                log.warning("run %s: run.json signature override %s", rw.run_id, p)
            if not problems and rw.override_problems:
                log.info("run %s: its run.json signature overrides are all applied now", rw.run_id)
        rw.override_problems = problems
        state.sig_config = (rw.meta, cfg)
        return cfg

    def evaluate_idle(self, states: Iterable[RunState]) -> None:
        """Evaluate the live runs that wrote nothing for :data:`IDLE_EVAL_S` (``stalled``)."""
        now = self.clock()
        for state in list(states):
            rw = state.watch
            if rw.meta is None or not rw.ranks or rw.all_ended:
                continue
            if now - state.last_eval_s >= IDLE_EVAL_S:
                self.evaluate(state)

    def act(self, state: RunState, d: Decision) -> None:
        """Carry out a policy :class:`Decision` for the run of ``state``."""
        rw = state.watch
        for a in d.suppressed:
            self.stats.alerts_suppressed += 1
            self.notifier.am_fire_quietly(rw, a)
            log.info("run %s: %s fired again at step %d within %g s of its last alert: not "
                     "notified (alert_interval_s)", rw.run_id, a.key, a.step, self.cfg.alert_interval_s)
        # What cleared is resolved before anything fires: a nonfinite incident that recovered
        # and broke again is the same Alertmanager alert, resolved and then fired anew.
        last = rw.last_step or 0
        for a in d.resolved_quietly:
            self.notifier.am_resolve(rw, a)
        for a in d.recovered:
            self.notifier.recovery(rw, a, rw.recovery_step(a.signature, a.step, last))
        state.held.update(d.hold)
        for a in d.alert:
            self._alert(state, a)
        for key in d.dropped_holds:
            state.held.pop(key, None)
        for a in d.grown:
            self.notifier.am_refresh(rw, a)
        for a in d.closed:  # the run ended: nothing fires any more, and nothing recovered
            log.info("run %s ended: %s closed (its Alertmanager page stays open)", rw.run_id, a.key)
        if d.incident_over:
            self.notifier.am_resolve_extras(rw)
        if d.changed:
            self.save(state)
            self._update_active_gauge(state)

    def due(self, states: Iterable[RunState]) -> list[tuple[RunState, list[str]]]:
        """Take the held alerts whose grace is over: ``[(state, keys still active)]``. The caller
        reads each run again (what the other ranks wrote meanwhile), then :meth:`release`."""
        now = self.clock()
        out = []
        for state in list(states):
            keys = due_holds(state.held, now)
            for key in keys:
                del state.held[key]
            active = [k for k in keys if k in state.watch.active]
            if active:
                out.append((state, active))
        return out

    def release(self, state: RunState, keys: Iterable[str]) -> None:
        """Send the held alerts ``keys`` of the run (those still active after its last read)."""
        rw = state.watch
        for key in keys:
            if key in rw.active:
                self._alert(state, active_from_dict(rw.active[key]))
        if rw.all_ended:
            self.evaluate(state)  # sent: now close what a finished run left active

    def _alert(self, state: RunState, a: Active) -> None:
        # Outbox first (fsynced), then the progress that says it was sent: a crash in between
        # repeats the enqueue after the restart (same id: a no-op), never loses the alert.
        rw = state.watch
        self.notifier.alert(rw, a)
        rw.last_alert_s[a.key] = self.clock()
        if a.key in rw.active:
            rw.active[a.key]["notified"] = True
            self.save(state)

    def _update_active_gauge(self, state: RunState) -> None:
        from sentineld.signatures.base import SIGNATURES  # noqa: PLC0415

        rw = state.watch
        for sig, sev in SIGNATURES.items():
            self.metrics.signature_active(rw.run_id, sig, sev, any(a["signature"] == sig for a in rw.active.values()))
