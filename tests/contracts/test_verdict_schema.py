"""The verdict schema's own checks (schema 2): module is a model's qualified name or null, and a
null module says where; the cause class is one of the known ones; the text forms show ``where``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sentineld.contracts.verdict import (
    CAUSE_CLASSES,
    OUTSIDE_MODEL,
    REPORT_SCHEMA_VERSION,
    CompiledCheck,
    Finding,
    Replayed,
    Report,
    WhatIf,
    make_report,
    notification_text,
    render_text,
    report_problems,
    verdict_outcome,
)


def _outside() -> Report:
    return Report(run_id="r", rank=0, step=4, requested_step=4, phase="backward", module=None,
                  where=OUTSIDE_MODEL, op="aten.sqrt", autograd_node="SqrtBackward0",
                  cause_class="grad_at_singularity", cause="c", fix="f")


def test_a_null_module_verdict_is_valid_and_says_where() -> None:
    r = _outside()
    obj = json.loads(r.to_json())
    assert obj["schema_version"] == REPORT_SCHEMA_VERSION == 3
    assert report_problems(obj) == []
    text = render_text(r)
    assert "went non-finite in backward, in the loss function, outside the model" in text.splitlines()[0]
    assert "op: aten.sqrt" in text
    _, body = notification_text(obj)
    assert "module: loss function, outside the model" in body


@pytest.mark.parametrize("change, problem", [
    ({"where": None}, "must say where"),
    ({"module": 3}, "module must be"),
    ({"cause_class": "clip_gradients"}, "cause_class 'clip_gradients'"),
    ({"where": ["x"]}, "where must be"),
    # the shape the daemon checks a replay subprocess's output against (was is_verdict)
    ({"phase": "everything is fine"}, "phase must be one of"),
    ({"step": "7"}, "step must be int"),
    ({"reproduced": "yes"}, "reproduced must be bool"),
    ({"schema_version": None}, "schema_version must be int"),
])
def test_report_problems_names_what_is_wrong(change: dict, problem: str) -> None:
    obj = json.loads(_outside().to_json()) | change
    probs = report_problems(obj)
    assert len(probs) >= 1 and any(problem in p for p in probs), probs


def test_cause_classes_are_described() -> None:
    assert all(k.isidentifier() and v for k, v in CAUSE_CLASSES.items())
    assert {"custom_backward", "where_masked_branch", "grad_at_singularity"} <= set(CAUSE_CLASSES)


def test_report_problems_checks_the_run_when_named() -> None:
    obj = json.loads(_outside().to_json())
    assert report_problems(obj, "r") == []
    assert any("run_id must be 'r2'" in p for p in report_problems(obj, "r2"))
    assert report_problems([obj]) == ["a verdict is a JSON object, got list"]


@pytest.mark.parametrize("phase, reproduced, outcome", [
    ("forward", True, "localized"),
    ("optimizer", True, "localized"),
    ("none", True, "not_localized"),
    ("forward", False, "not_reproduced"),
    ("none", False, "not_reproduced"),
])
def test_one_outcome_rule(phase: str, reproduced: bool, outcome: str) -> None:
    assert verdict_outcome({"phase": phase, "reproduced": reproduced}) == outcome


def test_a_report_is_made_once_from_what_the_replay_found() -> None:
    found = Finding(step=5, phase="forward", module="fc1", module_type="Linear", where="module 'fc1' (Linear)",
                    op="aten.log", cause_class="log_zero", cause="c", fix="f", evidence={"replayed_loss": 1.0})
    r = make_report(Replayed(found, requested_step=4, reproduced=True, rank=1, capture="cap.h5", steps_rebuilt=3,
                             evidence={"snapshot_step": 2}), "run7", evidence={"in_process": {"mode": "thread"}},
                    elapsed_s=2.5)
    assert (r.run_id, r.rank, r.step, r.requested_step, r.phase, r.module, r.op) == (
        "run7", 1, 5, 4, "forward", "fc1", "aten.log")
    assert r.evidence == {"replayed_loss": 1.0, "snapshot_step": 2, "in_process": {"mode": "thread"}}
    assert (r.elapsed_s, r.steps_rebuilt, r.capture) == (2.5, 3, "cap.h5")
    assert report_problems(json.loads(r.to_json()), "run7") == []


def test_a_spike_finding_with_what_if_and_a_compiled_check_makes_the_whole_verdict() -> None:
    """Issue 26: the spike path, --what-if and the compiled check return values; the one
    make_report call writes them into the verdict, which nothing changes after (frozen)."""
    found = Finding(step=40, kind="spike", cause_class="data", samples=[3, 1], where="input batch of step 40",
                    evidence={"spike_bar": 2.0})
    wi = WhatIf(rows=[{"change": "lr x0.1", "finite": True}], summary={"total_s": 0.5},
                reproducibility={"class": "software", "wall_s": 0.25})
    compiled = CompiledCheck(eager_reproduced=False, evidence={"replayed": "eager"}, tolerance=1e-4,
                             max_loss_deviation=3e-5)
    r = make_report(Replayed(found, requested_step=40, reproduced=False, max_loss_deviation=0.5,
                             evidence={"snapshot_step": 36}), "run8", what_if=wi, compiled=compiled)
    assert (r.kind, r.phase, r.samples, r.cause_class) == ("spike", "none", [3, 1], "data")
    assert r.what_if == wi.rows and r.reproducibility == wi.reproducibility
    assert r.evidence == {"spike_bar": 2.0, "snapshot_step": 36, "what_if": {"total_s": 0.5},
                          "compiled": {"replayed": "eager"}}
    # within the compiled run's tolerance: reproduced under it, with the deviation it found
    assert (r.compiled, r.eager_reproduced, r.reproduced, r.loss_tolerance, r.max_loss_deviation) == (
        True, False, True, 1e-4, 3e-5)
    assert verdict_outcome(json.loads(r.to_json())) == "localized"
    assert report_problems(json.loads(r.to_json()), "run8") == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.phase = "forward"  # type: ignore[misc]
    eager = make_report(Replayed(found, requested_step=40, reproduced=False, max_loss_deviation=0.5), "run8")
    assert (eager.compiled, eager.eager_reproduced, eager.reproduced, eager.max_loss_deviation,
            eager.what_if, eager.reproducibility) == (False, None, False, 0.5, [], None)


def test_a_replays_evidence_is_passed_in_whole_never_added_to_after() -> None:
    """replay/ddp.py added ``fsdp`` to a built Replayed's evidence (3793601); a verdict is built
    once from what the replay found (make_report), so that evidence is read-only now."""
    from sentineld.contracts.verdict import Finding, Replayed, make_report  # noqa: PLC0415

    given = {"ddp": {"world_size": 2}}
    r = Replayed(Finding(3, phase="forward", module="m", where="m"), requested_step=3, reproduced=True,
                 evidence=given)
    with pytest.raises(TypeError):
        r.evidence["fsdp"] = {}  # type: ignore[index]
    given["late"] = 1  # the caller's dict is copied, not kept
    v = make_report(r, "run")
    assert v.evidence == {"ddp": {"world_size": 2}} and type(v.evidence) is dict
    assert '"world_size": 2' in v.to_json()
