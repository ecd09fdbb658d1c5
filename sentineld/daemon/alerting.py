"""The daemon's alerting: evaluate a run's signatures, carry out the policy's decision.

What to alert on is decided by :func:`sentineld.daemon.policy.decide` (pure); this mixin of
:class:`~sentineld.daemon.service.Daemon` feeds it a run's windows and does what it decided:
notifications through the :class:`~sentineld.daemon.notifier.Notifier`, holds for multi-rank
runs, saved progress, and the active-signature gauge.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from sentineld.daemon.daemon_config import DaemonConfig
from sentineld.daemon.loops import Stats
from sentineld.daemon.notifier import Notifier
from sentineld.daemon.policy import Active, Decision, active_from_dict, decide, due_holds
from sentineld.daemon.runwatch import RunWatch

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
    """Signature evaluation and alerting over the daemon's runs (a mixin of ``Daemon``, which
    owns the attributes declared here)."""

    cfg: DaemonConfig
    clock: Callable[[], float]
    notifier: Notifier
    stats: Stats
    runs: dict[str, RunWatch]
    _metrics: dict[str, Any]
    _held: dict[tuple[str, str], float]
    _last_eval: dict[str, float]
    _sig_config: Any

    def _save(self, rw: RunWatch) -> None:
        raise NotImplementedError

    def _process(self, run_dir: Path) -> None:
        raise NotImplementedError

    def _idle_evaluations(self) -> None:
        now = self.clock()
        for rw in list(self.runs.values()):
            if rw.meta is None or not rw.tails or len(rw.ended) >= len(rw.tails):
                continue
            if now - self._last_eval.get(str(rw.run_dir), 0.0) >= IDLE_EVAL_S:
                self._evaluate(rw)

    # ------------------------------------------------------------- alerting
    def _evaluate(self, rw: RunWatch, live: bool = True) -> None:
        """Evaluate the signatures over ``rw``'s windows and carry out the policy's decision;
        ``live`` is False while catching up on old records (then ``stalled`` is not judged
        against the current time)."""
        from sentineld.signatures import evaluate, run_signature_config, unresolved  # noqa: PLC0415

        sig_config = run_signature_config(self._sig_config, rw.meta.extra if rw.meta else None)
        now = self.clock()
        self._last_eval[str(rw.run_dir)] = now
        per_rank = {}
        for rank, window in rw.records.items():
            if not window:
                continue
            now_s = None if (rank in rw.ended or not live) else now
            per_rank[rank] = evaluate(list(window), sig_config, now_s=now_s,
                                      num_classes=rw.meta.num_classes if rw.meta else None)
        if not per_rank:
            return
        holding = unresolved(rw.active, {r: list(w) for r, w in rw.records.items() if w},  # issue 21
                             sig_config, rw.meta.num_classes if rw.meta else None) if rw.active else set()
        d = decide(rw.active, per_rank, now_s=now, last_alert_s=rw.last_alert_s, holding=holding,
                   held=[k for (run, k) in self._held if run == str(rw.run_dir)],
                   multi_rank=rw.meta is not None and rw.meta.world_size > 1,
                   alert_interval_s=self.cfg.alert_interval_s, rank_grace_s=RANK_GRACE_S,
                   ended=rw.all_ended, min_firing_s=MIN_FIRING_S)
        rw.active = d.active
        self._act(rw, d)

    def _act(self, rw: RunWatch, d: Decision) -> None:
        """Carry out a policy :class:`Decision` for ``rw``."""
        run_key = str(rw.run_dir)
        for a in d.suppressed:
            self.stats.alerts_suppressed += 1
            self.notifier.am_fire_quietly(rw, a)
            log.info("run %s: %s fired again at step %d within %g s of its last alert: not "
                     "notified (alert_interval_s)", rw.run_id, a.key, a.step, self.cfg.alert_interval_s)
        # What cleared is resolved before anything fires: a nonfinite incident that recovered
        # and broke again is the same Alertmanager alert, resolved and then fired anew.
        last = max(rw.last_step.values(), default=0)
        for a in d.resolved_quietly:
            self.notifier.am_resolve(rw, a)
        for a in d.recovered:
            self.notifier.recovery(rw, a, rw.recovery_step(a.signature, a.step, last))
        for key, until in d.hold.items():
            self._held[(run_key, key)] = until
        for a in d.alert:
            self._alert(rw, a)
        for key in d.dropped_holds:
            self._held.pop((run_key, key), None)
        for a in d.grown:
            self.notifier.am_refresh(rw, a)
        for a in d.closed:  # the run ended: nothing fires any more, and nothing recovered
            log.info("run %s ended: %s closed (its Alertmanager page stays open)", rw.run_id, a.key)
        if d.incident_over:
            self.notifier.am_resolve_extras(rw)
        if d.changed:
            self._save(rw)
            self._update_active_gauge(rw)

    def _alert(self, rw: RunWatch, a: Active) -> None:
        # Outbox first (fsynced), then the progress that says it was sent: a crash in between
        # repeats the enqueue after the restart (same id: a no-op), never loses the alert.
        self.notifier.alert(rw, a)
        rw.last_alert_s[a.key] = self.clock()
        if a.key in rw.active:
            rw.active[a.key]["notified"] = True
            self._save(rw)

    def _release_held(self) -> None:
        due = due_holds(self._held, self.clock())
        for run_key, key in due:
            del self._held[(run_key, key)]
        for run_key in dict.fromkeys(run for run, _ in due):
            rw = self.runs.get(run_key)
            if rw is None:
                continue
            keys = [k for run, k in due if run == run_key and k in rw.active]
            if keys:
                self._process(rw.run_dir)  # read what the other ranks wrote meanwhile
            for key in keys:
                if key in rw.active:
                    self._alert(rw, active_from_dict(rw.active[key]))
            if keys and rw.all_ended:
                self._evaluate(rw)  # sent: now close what a finished run left active

    def _update_active_gauge(self, rw: RunWatch) -> None:
        g = self._metrics.get("active")
        if g is None:
            return
        for sig, sev in _all_signatures():
            g.labels(rw.run_id, sig, sev).set(1 if any(
                a["signature"] == sig for a in rw.active.values()) else 0)


def _all_signatures() -> list[tuple[str, str]]:
    from sentineld.signatures.base import SIGNATURES  # noqa: PLC0415

    return list(SIGNATURES.items())
