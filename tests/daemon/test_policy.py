"""Truth tables of the daemon's pure alert policy (sentineld.daemon.policy): one row per rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sentineld.contracts.nonfinite import REARM_STEPS
from sentineld.daemon.policy import Active, decide, due_holds, merge_verdicts, transitions


@dataclass(frozen=True)
class V:  # the fields of a signatures Verdict the policy reads
    signature: str
    step: int
    module: str | None = None
    severity: str = "critical"
    message: str = "m"
    numbers: dict = field(default_factory=dict)
    fix: str = "f"


def _saved(sig: str, step: int = 3, ranks=(0,), **extra) -> dict:
    return {"signature": sig, "module": None, "step": step, "ranks": list(ranks),
            "severity": "critical", "message": "m", "numbers": {}, "fix": "f", "notified": True, **extra}


def _decide(active, per_rank, now=100.0, last=None, held=(), multi=False, ended=False, min_firing=0.0):
    return decide(active, per_rank, now_s=now, last_alert_s=last or {}, held=held, multi_rank=multi,
                  alert_interval_s=60.0, rank_grace_s=2.0, ended=ended, min_firing_s=min_firing)


def _again(step: int, before: int) -> V:
    """A nonfinite verdict for an incident ``before`` finite steps after the previous one."""
    return V("nonfinite", step, numbers={"finite_steps_before": before})


# (name, active before, verdicts per rank, last alert, held, multi-rank,
#  expected: alert keys, hold keys, suppressed keys, recovered keys, quiet resolves, dropped holds, active keys)
ROWS = [
    ("new signature alerts", {}, {0: [V("nonfinite", 5)]}, {}, (), False,
     ["nonfinite"], [], [], [], [], [], ["nonfinite"]),
    ("still firing: nothing new", {"plateau": _saved("plateau")}, {0: [V("plateau", 9)]}, {}, (), False,
     [], [], [], [], [], [], ["plateau"]),
    ("cleared: recovery", {"plateau": _saved("plateau")}, {0: []}, {}, (), False,
     [], [], [], ["plateau"], [], [], []),
    ("again within alert_interval_s: suppressed", {}, {0: [V("plateau", 9)]}, {"plateau": 70.0}, (), False,
     [], [], ["plateau"], [], [], [], ["plateau"]),
    ("again after alert_interval_s: alerts", {}, {0: [V("plateau", 9)]}, {"plateau": 39.0}, (), False,
     ["plateau"], [], [], [], [], [], ["plateau"]),
    ("suppressed clears: no recovery notice", {"plateau": _saved("plateau", suppressed=True)}, {0: []},
     {}, (), False, [], [], [], [], ["plateau"], [], []),
    ("multi-rank: held, not sent", {}, {0: [V("nonfinite", 5)]}, {}, (), True,
     [], ["nonfinite"], [], [], [], [], ["nonfinite"]),
    ("held clears: never sent, no recovery", {"nonfinite": _saved("nonfinite", notified=False)}, {0: []},
     {}, ("nonfinite",), True, [], [], [], [], [], ["nonfinite"], []),
    ("nonfinite masks the others", {}, {0: [V("nonfinite", 5), V("dead_relu", 5, "fc"), V("stalled", 5)]},
     {}, (), False, ["nonfinite", "stalled"], [], [], [], [], [], ["nonfinite", "stalled"]),
    ("nonfinite again after its recovery: alerts within alert_interval_s", {},
     {0: [V("nonfinite", 61)]}, {"nonfinite": 70.0}, (), False,
     ["nonfinite"], [], [], [], [], [], ["nonfinite"]),
    ("nonfinite recovered and broke again between two evaluations: recovery + alert",
     {"nonfinite": _saved("nonfinite", 10)}, {0: [_again(61, REARM_STEPS)]}, {"nonfinite": 99.0}, (), False,
     ["nonfinite"], [], [], ["nonfinite"], [], [], ["nonfinite"]),
    ("nonfinite at a later step without a recovery before it: the same incident",
     {"nonfinite": _saved("nonfinite", 10)}, {0: [_again(61, REARM_STEPS - 1)]}, {}, (), False,
     [], [], [], [], [], [], ["nonfinite"]),
    ("module keys are separate", {}, {0: [V("dead_relu", 5, "a"), V("dead_relu", 5, "b")]}, {}, (), False,
     ["dead_relu@a", "dead_relu@b"], [], [], [], [], [], ["dead_relu@a", "dead_relu@b"]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_truth_table(row):
    _, before, per_rank, last, held, multi, alert, hold, supp, rec, quiet, dropped, after = row
    snapshot = {k: dict(v) for k, v in before.items()}
    d = _decide(before, per_rank, last=last, held=held, multi=multi)
    assert [a.key for a in d.alert] == alert
    assert sorted(d.hold) == hold
    assert [a.key for a in d.suppressed] == supp
    assert [a.key for a in d.recovered] == rec
    assert [a.key for a in d.resolved_quietly] == quiet
    assert d.dropped_holds == dropped
    assert sorted(d.active) == sorted(after)
    assert d.changed is bool(alert or hold or supp or rec or quiet or dropped)
    assert before == snapshot  # pure: the caller's state is not touched


def test_hold_lasts_rank_grace_and_is_released_when_due():
    d = _decide({}, {0: [V("nonfinite", 5)]}, now=100.0, multi=True)
    assert d.hold == {"nonfinite": 102.0}
    held = {("run", k): t for k, t in d.hold.items()}
    assert due_holds(held, 101.9) == []
    assert due_holds(held, 102.0) == [("run", "nonfinite")]


def test_ranks_merge_earliest_step_first_and_late_ranks_join():
    merged = merge_verdicts({1: [V("nonfinite", 4)], 0: [V("nonfinite", 6)]})
    assert merged["nonfinite"].step == 4 and merged["nonfinite"].ranks == [0, 1]
    d = _decide({"nonfinite": _saved("nonfinite", ranks=(0,))}, {2: [V("nonfinite", 7)]})
    assert d.active["nonfinite"]["ranks"] == [0, 2] and not d.changed


def test_suppressed_state_is_marked_notified_and_suppressed():
    d = _decide({}, {0: [V("plateau", 9)]}, last={"plateau": 70.0})
    assert d.active["plateau"]["suppressed"] is True and d.active["plateau"]["notified"] is True


def test_transitions():
    now = {"a": Active("a", None, 1, [0], "warning", "", {}, "")}
    fired, cleared = transitions(["b"], now)
    assert [a.key for a in fired] == ["a"] and cleared == ["b"]


def test_a_rank_joining_a_notified_alert_is_re_posted_not_re_notified():
    """Issue 16: rank 1 scraped after the page went out must still appear on it (d9bb298 kept it
    in the daemon's state only, so Alertmanager's page named rank 0 alone)."""
    d = _decide({"nonfinite": _saved("nonfinite", ranks=(0,))}, {0: [V("nonfinite", 3)], 1: [V("nonfinite", 3)]})
    assert [(a.key, a.ranks) for a in d.grown] == [("nonfinite", [0, 1])]
    assert d.alert == [] and not d.changed
    held = _decide({"nonfinite": _saved("nonfinite", ranks=(0,), notified=False)}, {1: [V("nonfinite", 3)]})
    assert held.grown == []  # not sent yet: the held alert names every rank when it goes out
    same = _decide({"nonfinite": _saved("nonfinite", ranks=(0, 1))}, {1: [V("nonfinite", 3)]})
    assert same.grown == []


def test_incident_is_over_only_when_the_last_signature_clears():
    both = {"nonfinite": _saved("nonfinite"), "stalled": _saved("stalled")}
    assert _decide(both, {0: [V("stalled", 9)]}).incident_over is False
    assert _decide({"stalled": _saved("stalled")}, {0: []}).incident_over is True
    assert _decide({}, {0: []}).incident_over is False  # nothing cleared: no incident ended
    assert _decide({}, {0: [V("plateau", 9)]}).incident_over is False


def test_an_ended_run_closes_its_signatures_without_a_recovery_notice():
    d = _decide({"nonfinite": _saved("nonfinite", 5)}, {0: [V("nonfinite", 5)]}, ended=True)
    assert [a.key for a in d.closed] == ["nonfinite"] and d.recovered == [] and d.alert == []
    assert d.active == {} and d.changed
    assert not d.incident_over  # its page (and the verdict in it) stays for on-call


def test_an_ended_run_alerts_what_it_showed_then_closes_it():
    d = _decide({}, {0: [V("nonfinite", 5)]}, ended=True)
    assert [a.key for a in d.alert] == ["nonfinite"] and [a.key for a in d.closed] == ["nonfinite"]
    assert d.active == {}


def test_an_ended_run_keeps_a_held_alert_until_it_is_sent():
    # (a run first seen after it ended alerts at once, with no hold: tested below)
    held = _decide({"nonfinite": _saved("nonfinite", 5, notified=False)}, {0: [V("nonfinite", 5)]},
                   held=("nonfinite",), multi=True, ended=True)
    assert held.closed == [] and sorted(held.active) == ["nonfinite"]


def test_a_running_run_closes_nothing():
    d = _decide({"nonfinite": _saved("nonfinite", 5)}, {0: [V("nonfinite", 5)]})
    assert d.closed == [] and sorted(d.active) == ["nonfinite"] and not d.changed


def test_an_alert_cleared_within_min_firing_s_is_announced_later():
    """A NaN over within seconds still reaches Alertmanager's group_wait (tests/deploy/test_oncall)."""
    saved = {"nonfinite": _saved("nonfinite", 5)}
    young = _decide(saved, {0: []}, now=105.0, last={"nonfinite": 100.0}, min_firing=15.0)
    assert young.recovered == [] and sorted(young.active) == ["nonfinite"] and not young.incident_over
    old = _decide(saved, {0: []}, now=116.0, last={"nonfinite": 100.0}, min_firing=15.0)
    assert [a.key for a in old.recovered] == ["nonfinite"] and old.active == {} and old.incident_over
    ended = _decide(saved, {0: []}, now=105.0, last={"nonfinite": 100.0}, min_firing=15.0, ended=True)
    assert [a.key for a in ended.recovered] == ["nonfinite"] and ended.closed == []  # it did recover
    again = _decide(saved, {0: [_again(61, REARM_STEPS)]}, now=105.0, last={"nonfinite": 100.0}, min_firing=15.0)
    assert [a.key for a in again.recovered] == ["nonfinite"] and [a.step for a in again.alert] == [61]


def test_a_released_hold_of_an_ended_run_is_not_closed_before_its_alert():
    """Regression: a two-rank run the daemon first read after it ended. Its held alert was
    released (no longer held), the re-read closed it before the alert went out, the next read
    held it again: the run was never alerted (every 2 s: 'nonfinite closed')."""
    released = _decide({"nonfinite": _saved("nonfinite", 5, notified=False)}, {0: [V("nonfinite", 5)]},
                       multi=True, ended=True)
    assert released.closed == [] and sorted(released.active) == ["nonfinite"]
    sent = _decide({"nonfinite": _saved("nonfinite", 5)}, {0: [V("nonfinite", 5)]},
                   last={"nonfinite": 99.0}, multi=True, ended=True)
    assert [a.key for a in sent.closed] == ["nonfinite"] and sent.active == {}


def test_an_ended_multi_rank_run_alerts_at_once_and_a_reread_alerts_nothing_again():
    first = _decide({}, {0: [V("nonfinite", 5)], 1: [V("nonfinite", 5)]}, multi=True, ended=True)
    assert [a.key for a in first.alert] == ["nonfinite"] and first.hold == {}
    again = _decide({}, {0: [V("nonfinite", 5)]}, last={"nonfinite": 99.0}, multi=True, ended=True)
    assert again.alert == [] and again.hold == {} and again.active == {}
