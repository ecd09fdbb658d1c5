"""Truth tables of RESOLVED (issue 21): the policy announces a recovery only for a signature shown
over (sentineld.daemon.policy ``holding``, sentineld.signatures.resolve), and a non-finite run
resolves nothing but ``nonfinite``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.daemon.policy import decide
from sentineld.signatures import SignatureConfig, shown_resolved, unresolved

NAN = float("nan")
LN3 = math.log(3)


@dataclass(frozen=True)
class V:
    signature: str
    step: int
    module: str | None = None
    severity: str = "critical"
    message: str = "m"
    numbers: dict = field(default_factory=dict)
    fix: str = "f"


def _saved(sig: str, step: int = 3, numbers: dict | None = None, **extra) -> dict:
    return {"signature": sig, "module": None, "step": step, "ranks": [0], "severity": "warning",
            "message": "m", "numbers": numbers or {}, "fix": "f", "notified": True, **extra}


def _decide(active, verdicts, holding=(), ended=False):
    return decide(active, {0: verdicts}, now_s=100.0, last_alert_s={}, held=(), multi_rank=False,
                  alert_interval_s=60.0, rank_grace_s=2.0, ended=ended, holding=holding)


# (name, active before, verdicts now, holding, ended, expected recovered, closed, active after)
ROWS = [
    ("quiet and shown over: recovered", {"plateau": _saved("plateau")}, [], (), False,
     ["plateau"], [], []),
    ("quiet but not shown over: kept, no notice", {"plateau": _saved("plateau")}, [], ("plateau",), False,
     [], [], ["plateau"]),
    ("not shown over when the run ends: closed, no notice", {"plateau": _saved("plateau")}, [],
     ("plateau",), True, [], ["plateau"], []),
    ("nonfinite fires: the others are kept, not recovered",
     {"vanishing_gradients": _saved("vanishing_gradients")}, [V("nonfinite", 60)], (), False,
     [], [], ["nonfinite", "vanishing_gradients"]),
    ("nonfinite fires: stalled still clears",
     {"stalled": _saved("stalled")}, [V("nonfinite", 60)], (), False,
     ["stalled"], [], ["nonfinite"]),
    ("nonfinite shown over: recovered", {"nonfinite": _saved("nonfinite")}, [], (), False,
     ["nonfinite"], [], []),
    ("holding a key still firing changes nothing", {"plateau": _saved("plateau")}, [V("plateau", 9)],
     ("plateau",), False, [], [], ["plateau"]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_policy_resolved_rows(row) -> None:
    _name, active, verdicts, holding, ended, recovered, closed, after = row
    d = _decide(active, verdicts, holding, ended)
    assert [a.key for a in d.recovered] == recovered
    assert [a.key for a in d.closed] == closed
    assert sorted(d.active) == after


def _recs(losses, norms, start=0) -> list[StepRecord]:
    return [StepRecord(step=start + i, loss=loss, grad_norm=g) for i, (loss, g) in enumerate(zip(losses, norms))]


def _sampled(losses, at, nan_at=None) -> list[StepRecord]:
    """Records 100.. with layer stats at the offsets ``at`` (the alert was at step 100)."""
    out = []
    for i, loss in enumerate(losses):
        layers = {"fc": LayerStats(grad_norm=NAN if i == nan_at else 0.1, param_norm=1.0)} if i in at else None
        out.append(StepRecord(step=100 + i, loss=loss, grad_norm=NAN if i == nan_at else 0.5, layers=layers))
    return out


PLATEAU = {"loss_median": LN3, "reference": LN3}
CFG = SignatureConfig()

# (name, signature, numbers of the alert, records now, shown resolved)
RESOLVE_ROWS = [
    ("plateau: loss still at ln 3", "plateau", PLATEAU, _recs([LN3] * 20, [0.2] * 20), False),
    ("plateau: loss fell below the band", "plateau", PLATEAU, _recs([0.5] * 20, [0.2] * 20), True),
    ("plateau: 6% lower is still in the band (minibatch noise)", "plateau", PLATEAU,
     _recs([0.94 * LN3] * 20, [0.2] * 20), False),
    ("plateau: loss left upward (divergence's, not plateau's)", "plateau", PLATEAU,
     _recs([2.0 * LN3] * 20, [0.2] * 20), True),
    ("plateau: NaN data", "plateau", PLATEAU, _recs([NAN] * 20, [NAN] * 20), False),
    ("vanishing: NaN norms are not above the floor", "vanishing_gradients", {"grad_norm": 1e-9},
     _recs([2.3] * 20, [NAN] * 20), False),
    ("vanishing: norms back above the floor", "vanishing_gradients", {"grad_norm": 1e-9},
     _recs([2.3] * 20, [0.1] * 20), True),
    ("vanishing: one norm of the last 10 still below", "vanishing_gradients", {"grad_norm": 1e-9},
     _recs([2.3] * 20, [0.1] * 19 + [1e-9]), False),
    ("vanishing: too few records since", "vanishing_gradients", {"grad_norm": 1e-9},
     _recs([2.3] * 5, [0.1] * 5), False),
    ("exploding: norm still 50x the old baseline (the baseline caught up)", "exploding_gradients",
     {"baseline_median": 0.5}, _recs([1.0] * 20, [25.0] * 20), False),
    ("exploding: norm back under 10x the old baseline", "exploding_gradients",
     {"baseline_median": 0.5}, _recs([1.0] * 20, [0.6] * 20), True),
    ("divergence_spike: loss still over the bar", "divergence_spike", {"threshold": 1.5},
     _recs([2.0] * 20, [0.5] * 20), False),
    ("divergence_spike: loss back under the bar", "divergence_spike", {"threshold": 1.5},
     _recs([0.4] * 20, [0.5] * 20), True),
    ("divergence_growth: loss still high", "divergence_growth", {"loss_median_min": 0.1},
     _recs([2.0] * 20, [0.5] * 20), False),
    ("dead_relu: finite window, 2 samples since", "dead_relu", {}, _sampled([0.4] * 20, [5, 15]), True),
    ("dead_relu: one sample since", "dead_relu", {}, _sampled([0.4] * 20, [15]), False),
    ("update_ratio: a NaN sample since", "update_ratio", {}, _sampled([0.4] * 20, [3, 9, 15], nan_at=9), False),
    ("update_ratio: 3 finite samples since", "update_ratio", {}, _sampled([0.4] * 20, [3, 9, 15]), True),
    ("dead_relu: one NaN step in the window", "dead_relu", {},
     _sampled([0.4] * 19 + [NAN], [5, 15]), False),
    ("initial_loss: a fact about step 0", "initial_loss", {"loss": 40.0}, _recs([0.4] * 20, [0.5] * 20), False),
    ("nonfinite: its own re-arm rule", "nonfinite", {}, _recs([NAN] * 20, [NAN] * 20), True),
    ("stalled: records came", "stalled", {}, _recs([NAN] * 2, [NAN] * 2), True),
]


@pytest.mark.parametrize("row", RESOLVE_ROWS, ids=[r[0] for r in RESOLVE_ROWS])
def test_shown_resolved_rows(row) -> None:
    _name, sig, numbers, records, expected = row
    assert shown_resolved(sig, numbers, records, CFG, None, since_step=100) is expected


def test_unresolved_needs_every_rank() -> None:
    active = {"plateau": _saved("plateau", numbers=PLATEAU)}
    fine, stuck = _recs([0.5] * 20, [0.2] * 20), _recs([LN3] * 20, [0.2] * 20)
    assert unresolved(active, {0: fine, 1: fine}) == set()
    assert unresolved(active, {0: fine, 1: stuck}) == {"plateau"}
    assert unresolved(active, {}) == {"plateau"}
    assert unresolved({"x": "not a dict"}, {0: fine}) == set()  # type: ignore[dict-item]
