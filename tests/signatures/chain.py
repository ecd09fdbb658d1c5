"""The daemon's decision chain over a run's records, in process: signatures, then the policy.

:func:`notifications` does per new record what ``sentineld.daemon.alerting`` does per evaluation
(``evaluate`` over the last :data:`WINDOW` records, ``unresolved`` over the active alerts, then
``policy.decide``), one evaluation per record (the daemon evaluates at most that often, so this
sees every alert the daemon could send), and returns every notification it would send: alerts
and RESOLVED (recovery) notices. Pure functions only: the daemon process itself is tested in
tests/daemon and tests/e2e.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from sentineld.contracts.records import StepRecord
from sentineld.daemon.policy import decide
from sentineld.signatures import SignatureConfig, evaluate

try:  # absent before issue 21: the regression tests of this chain also run against 49179bb
    from sentineld.signatures import unresolved
except ImportError:  # pragma: no cover - only on the old code
    unresolved = None  # type: ignore[assignment]

__all__ = ["WINDOW", "notifications"]

#: records per evaluation, as the daemon keeps them (``RunWatch`` window)
WINDOW = 200
_HOLDING = "holding" in inspect.signature(decide).parameters


def notifications(records: Sequence[StepRecord], num_classes: int | None,
                  config: SignatureConfig | None = None, *, ended: bool = True
                  ) -> list[tuple[str, str, int]]:
    """``(kind, key, step)`` of every notification: kind ``alert`` (step: the verdict's) or
    ``resolved`` (step: the run's last step then, as the daemon's recovery notice says).

    Args:
        records: the run's step records, oldest first.
        num_classes: as the run's run.json gives it.
        config: the daemon's signature config; None: the defaults.
        ended: evaluate once more as the daemon does when the run's ``end`` record arrives.
    """
    active: dict[str, dict[str, Any]] = {}
    last_alert: dict[str, float] = {}
    out: list[tuple[str, str, int]] = []
    now = 0.0
    n = len(records)
    for i in range(n + (1 if ended else 0)):
        last = i >= n
        window = list(records[max(0, min(i, n - 1) + 1 - WINDOW):min(i, n - 1) + 1])
        if not window:
            break
        now += 1.0  # a second of daemon clock per record: alert_interval_s (600 s) keeps its meaning
        verdicts = evaluate(window, config, now_s=None if last else window[-1].time_s + 0.5,
                            num_classes=num_classes)
        kwargs: dict[str, Any] = {}
        if _HOLDING and unresolved is not None:
            kwargs["holding"] = unresolved(active, {0: window}, config, num_classes) if active else set()
        d = decide(active, {0: verdicts}, now_s=now, last_alert_s=last_alert, held=(), multi_rank=False,
                   alert_interval_s=600.0, rank_grace_s=2.0, ended=last, min_firing_s=0.0, **kwargs)
        active = d.active
        for a in d.alert:
            out.append(("alert", a.key, a.step))
            last_alert[a.key] = now
            if a.key in active:
                active[a.key]["notified"] = True
        out.extend(("resolved", a.key, window[-1].step) for a in d.recovered)
    return out
