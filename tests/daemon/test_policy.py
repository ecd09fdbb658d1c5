"""Truth tables of the daemon's pure alert policy (sentineld.daemon.policy): one row per rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

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


def _decide(active, per_rank, now=100.0, last=None, held=(), multi=False):
    return decide(active, per_rank, now_s=now, last_alert_s=last or {}, held=held, multi_rank=multi,
                  alert_interval_s=60.0, rank_grace_s=2.0)


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
