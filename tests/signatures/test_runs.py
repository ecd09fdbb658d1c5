"""Tiny real training runs on CPU: every fault raises its signature within the stated number of
steps, and healthy runs of many shapes raise no verdict at all (evaluated the way the daemon
does: once per new record over the last 200 records)."""

from __future__ import annotations

import pytest

from sentineld.signatures import SIGNATURES, SignatureConfig, evaluate
from tests.signatures.scenarios import (FAULTY, HEALTHY, Scenario, first_fire, records_of,
                                        replay_daemon)


@pytest.mark.parametrize("known_classes", [True, False], ids=["num_classes", "no_num_classes"])
@pytest.mark.parametrize("sc", HEALTHY, ids=[s.name for s in HEALTHY])
def test_healthy_run_raises_nothing(sc: Scenario, known_classes: bool) -> None:
    records = records_of(sc.name)
    num_classes = sc.num_classes if known_classes else None
    alarms = [(r.step, v.signature, v.module, v.message)
              for r, verdicts in zip(records, replay_daemon(records, num_classes))
              for v in verdicts]
    assert alarms == [], f"{sc.name} ({sc.description}): false alarms {alarms[:5]}"


@pytest.mark.parametrize("sc", FAULTY, ids=[s.name for s in FAULTY])
def test_fault_raises_its_signature_in_time(sc: Scenario) -> None:
    records = records_of(sc.name)
    step = first_fire(records, sc.expect, sc.num_classes)  # type: ignore[arg-type]
    assert step is not None, f"{sc.name}: {sc.expect} never fired"
    latency = step - sc.fault_step
    assert 0 <= latency <= sc.max_latency, (
        f"{sc.name}: {sc.expect} fired at step {step}, {latency} steps after the fault "
        f"(bound {sc.max_latency})")
    # before the fault, the run was healthy: nothing at all fired
    early = [(r.step, v.signature) for r, vs in zip(records[:sc.fault_step],
                                                    replay_daemon(records[:sc.fault_step],
                                                                  sc.num_classes))
             for v in vs]
    assert early == []


def test_every_signature_has_a_faulty_run() -> None:
    # stalled: see below; replica_divergence: a real 3-rank run, tests/e2e/test_ddp_replicas.py
    covered = {sc.expect for sc in FAULTY} | {"stalled", "replica_divergence"}
    assert covered == set(SIGNATURES)


@pytest.mark.parametrize("overrides, limit_s", [({}, 1800.0),
                                                ({"step_multiple": 100.0}, 60.0)])
def test_stalled_run(overrides: dict, limit_s: float) -> None:
    """A run that stops writing steps at step 120 (a hang): ``stalled`` fires once the daemon's
    clock passes the limit, not before."""
    records = records_of("mlp_adam")[:121]
    cfg = SignatureConfig.from_mapping({"stalled": overrides})
    last = records[-1].time_s

    def fires(after_s: float) -> bool:
        return any(v.signature == "stalled"
                   for v in evaluate(records[-200:], cfg, now_s=last + after_s, num_classes=10))
    assert not fires(limit_s - 1.0)
    assert fires(limit_s + 1.0)
