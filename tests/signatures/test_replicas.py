"""``replica_divergence`` (issue 25): the truth table of the pure rule over a window whose records
the daemon tagged with the agent's replica_divergence line, its config, its resolve rule and the
stream line's contract."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sentineld.contracts.records import (
    REPLICA_DIVERGENCE,
    ReplicaDivergence,
    StepRecord,
    record_from_json,
    record_to_json,
)
from sentineld.signatures import SIGNATURES, SignatureConfig, evaluate, shown_resolved
from sentineld.signatures.replicas import REPLICA_FIX, ReplicaDivergenceConfig, detect_replica_divergence

DIV = ReplicaDivergence(step=25, ranks=(1,), parameter="fc1.weight", message="m")


def window(n: int = 40, tagged: dict[int, ReplicaDivergence] | None = None) -> list[StepRecord]:
    recs = [StepRecord(step=i, loss=2.0 - 0.01 * i, grad_norm=1.0) for i in range(n)]
    for i, d in (tagged or {}).items():
        recs[i] = replace(recs[i], replicas=d)
    return recs


@pytest.mark.parametrize("tagged, expect", [
    ({}, None),                                            # equal replicas: nothing
    ({30: DIV}, (25, "fc1.weight", [1])),                  # carried on a later record: the line's step
    ({10: DIV, 30: ReplicaDivergence(50, (0, 2), "fc2.bias")}, (50, "fc2.bias", [0, 2])),  # the latest
    ({39: ReplicaDivergence(75, (), "w")}, (75, "w", [])),  # no ranks named: still fires
])
def test_truth_table(tagged, expect) -> None:
    out = detect_replica_divergence(window(tagged=tagged), ReplicaDivergenceConfig())
    if expect is None:
        assert out == []
        return
    (v,) = out
    step, param, ranks = expect
    assert (v.signature, v.severity, v.step, v.fix) == ("replica_divergence", "critical", step, REPLICA_FIX)
    assert f"step {step}" in v.message and repr(param) in v.message
    assert v.numbers["ranks_differing"] == len(ranks)
    if ranks:
        assert f"rank(s) {', '.join(map(str, ranks))}" in v.message and v.numbers.get("first_rank") == ranks[0]


def test_disabled_empty_and_in_evaluate() -> None:
    assert detect_replica_divergence([], ReplicaDivergenceConfig()) == []
    assert detect_replica_divergence(window(tagged={5: DIV}), ReplicaDivergenceConfig(enabled=False)) == []
    assert [v.signature for v in evaluate(window(tagged={5: DIV}))] == ["replica_divergence"]
    cfg = SignatureConfig.from_mapping({"replica_divergence": {"enabled": False}})
    assert evaluate(window(tagged={5: DIV}), cfg) == []
    assert SIGNATURES["replica_divergence"] == "critical"


def test_never_resolves_while_the_run_lasts() -> None:
    """Nothing makes DDP replicas equal again: 40 clean steps after it are no recovery."""
    assert not shown_resolved("replica_divergence", {}, window(), None, None, 25)


def test_step_lines_never_carry_it_and_the_line_round_trips() -> None:
    rec = replace(StepRecord(step=3, loss=1.0), replicas=DIV)
    assert "replicas" not in record_to_json(rec)
    assert record_from_json({**record_to_json(rec), "replicas": {"x": 1}}).replicas is None
    line = DIV.to_json()
    assert line["kind"] == REPLICA_DIVERGENCE == "replica_divergence"
    assert ReplicaDivergence.from_json(line) == DIV


@pytest.mark.parametrize("bad", [{"step": "3", "ranks": [1], "parameter": "w"},
                                 {"step": 3, "ranks": "1", "parameter": "w"},
                                 {"step": 3, "ranks": [True], "parameter": "w"},
                                 {"step": 3, "ranks": [1]}])
def test_a_damaged_line_is_a_clear_error(bad) -> None:
    with pytest.raises(ValueError, match="replica_divergence line"):
        ReplicaDivergence.from_json(bad)
