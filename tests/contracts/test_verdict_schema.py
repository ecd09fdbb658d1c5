"""The verdict schema's own checks (schema 2): module is a model's qualified name or null, and a
null module says where; the cause class is one of the known ones; the text forms show ``where``."""

from __future__ import annotations

import json

import pytest

from sentineld.contracts.verdict import (
    CAUSE_CLASSES,
    OUTSIDE_MODEL,
    REPORT_SCHEMA_VERSION,
    Report,
    notification_text,
    render_text,
    report_problems,
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
    assert "module: - (-), loss function, outside the model" in body


@pytest.mark.parametrize("change, problem", [
    ({"where": None}, "must say where"),
    ({"module": 3}, "module must be"),
    ({"cause_class": "clip_gradients"}, "cause_class 'clip_gradients'"),
    ({"where": ["x"]}, "where must be"),
])
def test_report_problems_names_what_is_wrong(change: dict, problem: str) -> None:
    obj = json.loads(_outside().to_json()) | change
    probs = report_problems(obj)
    assert len(probs) >= 1 and any(problem in p for p in probs), probs


def test_cause_classes_are_described() -> None:
    assert all(k.isidentifier() and v for k, v in CAUSE_CLASSES.items())
    assert {"custom_backward", "where_masked_branch", "grad_at_singularity"} <= set(CAUSE_CLASSES)
