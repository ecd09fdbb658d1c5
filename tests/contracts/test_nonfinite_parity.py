"""One non-finite rule for both sides: the same training, watched by the real agent, gives a
capture at exactly the step where the daemon's ``nonfinite`` signature (``evaluate``, what the
daemon runs over the stream) puts its verdict, for a non-finite learning rate, grad norm, loss
and parameter.

On d9bb298 the learning-rate case failed: the agent captured at the nan-lr step, ``evaluate`` put
its verdict where the loss went nan later (the nan lr is used by the next optimizer step) and
never named the learning rate. The parameter case failed the other way: the signature fired at
the step whose sampled ``param_norm`` was nan, the agent only later, on the loss.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sentineld.agent import attach
from sentineld.contracts.capture import open_capture
from sentineld.contracts.nonfinite import REARM_STEPS, current_incident, is_nonfinite, nonfinite_reasons, recovered_at
from sentineld.contracts.records import StepRecord, record_from_json
from sentineld.contracts.rundir import list_captures
from sentineld.signatures import evaluate

FAULT_STEP = 5


def _train(tmp_path, fault: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), 0.1)
    watch = attach(m, opt, run_id=f"parity-{fault}", runs_dir=tmp_path, metrics_port=0,
                   snapshot_every=2, layer_every=1, post_steps=1, capture_on_sigterm=False)
    g = torch.Generator().manual_seed(1)
    for i in range(FAULT_STEP + 4):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        if fault == "grad_norm" and i == FAULT_STEP:
            m[0].weight.grad[0, 0] = float("inf")
        opt.step()
        if fault == "lr":  # nan for one step only, as read after that step's optimizer step
            opt.param_groups[0]["lr"] = float("nan") if i == FAULT_STEP else 0.1
        if fault == "parameter" and i == FAULT_STEP:
            with torch.no_grad():
                m[2].weight[0, 0] = float("nan")
        reported = torch.tensor(float("nan")) if fault == "loss" and i == FAULT_STEP else loss
        watch.step(reported, batch=(x, y))
        if fault == "parameter" and i == FAULT_STEP:
            with torch.no_grad():  # one sampled step only: the loss never goes non-finite
                m[2].weight[0, 0] = 0.0
    watch.close()
    lines = [json.loads(x) for x in (watch.run_dir / "stream-rank0.jsonl").read_text().splitlines()]
    return watch.run_dir, [record_from_json(o) for o in lines if o.get("kind") == "step"]


@pytest.mark.parametrize("fault,named", [("lr", "learning rate lr=nan"),
                                         ("grad_norm", "grad_norm=inf"),
                                         ("loss", "loss=nan"),
                                         ("parameter", "parameters of 2")])
def test_agent_capture_and_daemon_verdict_agree(tmp_path, fault, named):
    run_dir, records = _train(tmp_path, fault)
    captures = list_captures(run_dir)
    assert [(c[1], c[2]) for c in captures] == [(FAULT_STEP, "nonfinite")]
    with open_capture(captures[0][3]) as cap:
        assert FAULT_STEP in cap.steps
    verdicts = [v for v in evaluate(records) if v.signature == "nonfinite"]
    assert len(verdicts) == 1
    assert verdicts[0].step == FAULT_STEP
    assert named in verdicts[0].message
    assert [r.step for r in records if is_nonfinite(r)][0] == FAULT_STEP


# The rule itself, one row per field (the table the agent and the signature both follow).
@pytest.mark.parametrize("fields,reasons", [
    ({}, []),
    ({"loss": float("nan")}, ["loss=nan"]),
    ({"grad_norm": float("inf")}, ["grad_norm=inf"]),
    ({"grad_norm": float("inf"), "optimizer_skipped": True}, []),  # GradScaler doing its job
    ({"loss": float("nan"), "optimizer_skipped": True}, ["loss=nan"]),
    ({"lr": float("nan")}, ["learning rate lr=nan"]),
    ({"lr": float("-inf")}, ["learning rate lr=-inf"]),
    ({"lr": None, "grad_norm": None}, []),
    ({"param_nonfinite": True}, ["parameters"]),
    ({"input_nonfinite": True}, ["input batch"]),
])
def test_rule_table(fields, reasons):
    rec = StepRecord(**{"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": 0.1, **fields})
    assert nonfinite_reasons(rec) == reasons
    assert is_nonfinite(rec) is bool(reasons)


# Incidents: when one is over and the next begins, the same for the agent's captures and the
# daemon's alerts. Each pattern is a string: "x" a non-finite step, "." a finite one.
def _records(pattern: str) -> list[StepRecord]:
    return [StepRecord(step=i, loss=float("nan") if c == "x" else 1.0, grad_norm=1.0, lr=0.1)
            for i, c in enumerate(pattern)]


R = REARM_STEPS


@pytest.mark.parametrize("pattern,first,verdict_step", [
    ("." * 5, [], None),
    ("." * 5 + "x" + "." * (R - 1), [5], 5),                         # not yet recovered
    ("." * 5 + "x" + "." * R, [5], None),                            # recovered: cleared
    ("." * 5 + "x" + "." * (R - 1) + "x", [5], 5),                   # same incident
    ("." * 5 + "x" + "." * R + "x", [5, 6 + R], 6 + R),              # recovered, then a new one
    ("." * 5 + "xx.x" + "." * 50 + "xxx", [5, 59], 59),              # the 50 finite steps
])
def test_agent_incidents_and_daemon_verdict_follow_one_rule(pattern, first, verdict_step):
    from sentineld.agent.incidents import IncidentPolicy
    from sentineld.signatures.numerics import NonfiniteConfig, detect_nonfinite

    records = _records(pattern)
    policy = IncidentPolicy(REARM_STEPS, post_steps=0)
    opened = [inc.step for inc in (policy.observe(r)[1] for r in records) if inc is not None]
    assert opened == first
    verdicts = detect_nonfinite(records, NonfiniteConfig())
    assert [v.step for v in verdicts] == ([] if verdict_step is None else [verdict_step])
    inc = current_incident(records)
    assert (inc is None) is (verdict_step is None)
    if inc is not None and len(first) == 2:
        assert inc.finite_before >= REARM_STEPS  # what tells the policy it is a new incident


def test_an_incident_older_than_the_window_is_a_continuation():
    inc = current_incident(_records("xxxx" + "." * 3 + "x"))
    assert inc is not None and (inc.first, inc.nonfinite_steps, inc.finite_before) == (0, 5, 0)


def test_recovered_at_names_the_last_of_the_finite_steps_that_ended_it():
    records = _records("." * 5 + "xx.x" + "." * 50 + "x")
    assert recovered_at(records, 5) == 8 + REARM_STEPS
    assert recovered_at(records[:8 + REARM_STEPS], 5) is None
