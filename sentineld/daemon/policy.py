"""The daemon's alert policy, pure: a run's active signatures, its new verdicts and the time in;
the notifications to send and the new active set out. No I/O, no clock, no threads, so every rule
below has a row in ``tests/daemon/test_policy.py``.

Rules (all from the design; ``sentineld.daemon.service`` carries them out):

- one alert per (signature, module) across ranks: the earliest step, every rank that showed it
  (:func:`merge_verdicts`; data-parallel ranks fail together);
- once ``nonfinite`` fires, only ``nonfinite`` and ``stalled`` are kept: every other detector
  reads garbage over NaN values (a NaN layer looks "dead");
- a signature that starts firing is alerted, unless it fired within ``alert_interval_s`` of its
  last alert: then it is tracked (status, gauge, Alertmanager) but neither notified nor, when it
  clears, announced as recovered;
- in a multi-rank run a new alert is held ``rank_grace_s`` so it names every rank; one that
  clears while held was never sent and gets no recovery notice;
- a signature that stops firing gets a recovery notice at the run's last step, but only once it
  resolved (issue 21): keys in ``holding`` (:func:`sentineld.signatures.unresolved`: the records
  do not show the signature's own condition false for its window on finite data, or a plateau's
  loss still in its band) stay active without notice, and while ``nonfinite`` fires nothing else
  clears (a NaN run resolves nothing but ``nonfinite``; ``stalled`` is over when records come);
- ``nonfinite`` is an incident, not a threshold that flaps: it clears only after
  ``REARM_STEPS`` finite steps (:mod:`sentineld.contracts.nonfinite`), so a new incident after
  a recovery is alerted whatever ``alert_interval_s`` says, and one whose verdict comes at a
  later step with ``finite_steps_before >= REARM_STEPS`` (it recovered and broke again between
  two evaluations) is the old one recovered plus a new alert;
- a notified alert stays active at least ``min_firing_s`` after it was sent, so an incident over
  within seconds (``nonfinite`` now clears 20 finite steps after the NaN) still reaches
  Alertmanager's ``group_wait``; it clears at a later evaluation, or at once when the run ends;
- when every rank of a run has ended, its signatures are closed (``closed``): no longer active in
  ``status``, no recovery notice (nothing recovered), and its Alertmanager page stays open (an
  incident a run ended in is not over for on-call; issue 16); held alerts, and alerts whose hold
  was released but not yet sent, are sent first; a run first seen after it ended alerts at once
  (no rank grace: every rank's records are in), and a finished run read again alerts nothing it
  alerted before;
- a notified alert that more ranks join is re-posted to Alertmanager, so the page lists every
  rank (issue 16); when a run's last active signature clears, its incident is over.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from sentineld.contracts.nonfinite import REARM_STEPS

__all__ = ["Active", "Decision", "merge_verdicts", "transitions", "decide", "due_holds",
           "active_from_dict"]


@dataclass
class Active:
    """A firing signature of a run: first step, ranks that showed it, and the verdict's fields."""

    signature: str
    module: str | None
    step: int
    ranks: list[int]
    severity: str
    message: str
    numbers: dict[str, float]
    fix: str
    notified: bool = False

    @property
    def key(self) -> str:
        """``signature`` or ``signature@module``: the identity of one alert in a run."""
        return f"{self.signature}@{self.module}" if self.module else self.signature


def active_from_dict(d: Mapping[str, Any]) -> Active:
    """An :class:`Active` from its saved dict (extra keys such as ``suppressed`` are ignored)."""
    return Active(**{k: v for k, v in d.items() if k in Active.__dataclass_fields__})


def merge_verdicts(per_rank: Mapping[int, Sequence[Any]]) -> dict[str, Active]:
    """One :class:`Active` per (signature, module) across ranks: earliest step, all ranks named.

    The ranks of a data-parallel job fail together (gradients are all-reduced), so a run gets one
    alert naming every rank, and the rank with the earliest step first.
    """
    out: dict[str, Active] = {}
    for rank in sorted(per_rank):
        for v in per_rank[rank]:
            a = Active(v.signature, v.module, int(v.step), [rank], v.severity, v.message,
                       dict(v.numbers), v.fix)
            cur = out.get(a.key)
            if cur is None:
                out[a.key] = a
            else:
                if rank not in cur.ranks:
                    cur.ranks.append(rank)
                if a.step < cur.step:
                    a.ranks = cur.ranks
                    out[a.key] = a
    return out


def transitions(before: Iterable[str], now: Mapping[str, Active]) -> tuple[list[Active], list[str]]:
    """``(newly firing, cleared keys)`` between the previous and the current active sets."""
    prev = set(before)
    return [a for k, a in now.items() if k not in prev], sorted(prev - set(now))


@dataclass
class Decision:
    """What to do after one evaluation of a run.

    Attributes:
        active: the run's new active set (saved dicts, as ``RunWatch.active`` holds them).
        alert: alerts to send now.
        hold: alerts to send at the given time (multi-rank grace), by key.
        suppressed: alerts tracked but not notified (``alert_interval_s``): Alertmanager only.
        recovered: cleared alerts to announce (recovery notice and Alertmanager resolve).
        resolved_quietly: cleared suppressed alerts: Alertmanager resolve only, no notice.
        dropped_holds: keys of held alerts that cleared before they were sent.
        grown: notified alerts that more ranks joined (Alertmanager re-post only, no notice).
        closed: alerts of a run that ended, dropped from the active set (no notice, no resolve).
        incident_over: something cleared and nothing is active any more (the incident's verdict
            and crash alerts resolve with it).
    """

    active: dict[str, dict[str, Any]]
    alert: list[Active] = field(default_factory=list)
    hold: dict[str, float] = field(default_factory=dict)
    suppressed: list[Active] = field(default_factory=list)
    recovered: list[Active] = field(default_factory=list)
    resolved_quietly: list[Active] = field(default_factory=list)
    dropped_holds: list[str] = field(default_factory=list)
    grown: list[Active] = field(default_factory=list)
    closed: list[Active] = field(default_factory=list)
    incident_over: bool = False

    @property
    def changed(self) -> bool:
        """True when something started or stopped firing (the run's progress must be saved)."""
        return bool(self.alert or self.hold or self.suppressed or self.recovered
                    or self.resolved_quietly or self.dropped_holds or self.closed)


def _new_incident(saved: Mapping[str, Any], a: Active) -> bool:
    """True when ``a`` (firing now) is a later incident of the same signature than ``saved``."""
    return (a.signature == "nonfinite" and a.step > int(saved.get("step", a.step))
            and float(a.numbers.get("finite_steps_before", 0) or 0) >= REARM_STEPS)


def decide(active: Mapping[str, Mapping[str, Any]], per_rank: Mapping[int, Sequence[Any]], *,
           now_s: float, last_alert_s: Mapping[str, float], held: Iterable[str], multi_rank: bool,
           alert_interval_s: float, rank_grace_s: float, ended: bool = False,
           min_firing_s: float = 0.0, holding: Iterable[str] = ()) -> Decision:
    """Apply the module's rules to one evaluation of a run.

    Args:
        active: the run's active set before (``key -> saved Active dict``); not modified.
        per_rank: each rank's verdicts from :func:`sentineld.signatures.evaluate`.
        now_s: the daemon's clock, seconds.
        last_alert_s: when each key was last alerted (daemon clock, seconds).
        held: keys whose alert is held now.
        multi_rank: the run has more than one rank (``world_size > 1``).
        alert_interval_s: see the module docstring (daemon config).
        rank_grace_s: see the module docstring.
        ended: every rank of the run wrote its ``end`` record.
        min_firing_s: see the module docstring (``sentineld.daemon.alerting.MIN_FIRING_S``).
        holding: keys of active alerts not shown resolved (see the module docstring): while
            their detector is quiet they stay active, unannounced.

    Returns:
        A :class:`Decision`; its ``active`` is a new dict.
    """
    current = merge_verdicts(per_rank)
    keep = set(holding)
    if any(a.signature == "nonfinite" for a in current.values()):
        current = {k: a for k, a in current.items() if a.signature in ("nonfinite", "stalled")}
        keep |= {k for k, v in active.items() if v.get("signature") not in ("nonfinite", "stalled")}
    new: dict[str, dict[str, Any]] = {k: dict(v) for k, v in active.items()}
    for v in new.values():
        v["ranks"] = list(v.get("ranks", []))
    held_now = set(held)
    out = Decision(active=new)
    for key, a in current.items():  # recovered and broke again between two evaluations
        if key in new and key not in held_now and _new_incident(new[key], a):
            _clear(out, key, held_now)
    fired, cleared = transitions(new.keys(), current)
    cleared = [k for k in cleared if k not in keep]  # not over: kept (closed if the run ended)
    for key, a in current.items():
        if key in new:  # ranks that show a firing signature later join it
            ranks = new[key]["ranks"]
            joined = [r for r in a.ranks if r not in ranks]
            ranks.extend(joined)
            if joined and new[key].get("notified"):
                out.grown.append(active_from_dict(new[key]))
    for a in fired:
        last = last_alert_s.get(a.key)
        if ended and last is not None:
            continue  # a finished run re-read: what it showed was alerted (and closed) already
        if a.signature != "nonfinite" and last is not None and now_s - last < alert_interval_s:
            new[a.key] = {**asdict(a), "notified": True, "suppressed": True}
            out.suppressed.append(a)
            continue
        new[a.key] = asdict(a)
        if multi_rank and not ended:  # every rank ended: all their records are in, no grace
            out.hold[a.key] = now_s + rank_grace_s
        else:
            out.alert.append(a)
    for key in cleared:
        sent = last_alert_s.get(key)
        if (not ended and sent is not None and now_s - sent < min_firing_s
                and not new[key].get("suppressed") and key not in held_now):
            continue  # over, but announced at a later evaluation (Alertmanager's group_wait)
        _clear(out, key, held_now)
    if ended:
        # Close what was notified (or is being now); an alert still to be sent (a hold just
        # released, its alert not yet out) stays until it is: else a finished multi-rank run
        # seen after its end was never alerted.
        alerting = {a.key for a in out.alert}
        pending = {k for k, v in new.items() if not v.get("notified") and not v.get("suppressed")}
        for key in [k for k in new if k not in held_now and k not in out.hold
                    and (k in alerting or k not in pending)]:
            out.closed.append(active_from_dict(new.pop(key)))
    out.incident_over = bool(out.recovered or out.resolved_quietly or out.dropped_holds) and not new
    return out


def _clear(out: Decision, key: str, held_now: set[str]) -> None:
    """Move ``key`` out of ``out.active`` into the list that says how it ends."""
    d = out.active.pop(key)
    a = active_from_dict(d)
    if key in held_now:
        out.dropped_holds.append(key)
    if d.get("suppressed"):
        out.resolved_quietly.append(a)
    elif key not in held_now:
        out.recovered.append(a)


def due_holds(held: Mapping[tuple[str, str], float], now_s: float) -> list[tuple[str, str]]:
    """The held ``(run, key)`` alerts whose grace ended at ``now_s``, in hold order."""
    return [k for k, deadline in held.items() if now_s >= deadline]
