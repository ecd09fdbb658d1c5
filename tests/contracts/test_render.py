"""The one verdict renderer: tensor stats show NaN/+Inf/-Inf counts (on d9bb298 the replay text
showed ``[2.343, 2.916] ... 1 non-finite`` and hid that the value was -inf), and a step with
gradient accumulation names its micro-batch."""

from __future__ import annotations

from sentineld.contracts.render import format_body, render_verdict, rows_text, tensor_stats_text
from sentineld.contracts.verdict import Report, render_text


def _stats(**kw):
    base = {"dtype": "float32", "shape": [4], "numel": 4, "nan": 0, "posinf": 0, "neginf": 0, "nonfinite": 0,
            "zeros": 0, "min": 2.343, "max": 2.916, "finite_max_abs": 2.916}
    return {**base, **kw}


def test_stats_name_each_kind_of_nonfinite() -> None:
    assert tensor_stats_text(_stats(neginf=1, nonfinite=1)) == \
        "float32[4] finite range [2.343, 2.916], NaN 0, +Inf 0, -Inf 1"
    assert tensor_stats_text(_stats()) == "float32[4] finite range [2.343, 2.916], all finite"
    assert tensor_stats_text(_stats(nan=2, posinf=2, nonfinite=4, min=None, max=None, finite_max_abs=None)) == \
        "float32[4] no finite value, NaN 2, +Inf 2, -Inf 0"
    assert tensor_stats_text(None) == "-"


def test_accumulated_step_names_its_micro_batch() -> None:
    r = Report(run_id="acc", rank=0, step=6, requested_step=6, phase="forward", module="fc1", module_type="Linear",
               op="aten.addmm", reproduced=True,
               evidence={"micro_batch": 1, "micro_losses": [1.2, float("inf"), 1.1],
                         "op_inputs": [_stats(posinf=1, nonfinite=1)], "op_output": _stats(nan=4, nonfinite=4)})
    text = render_text(r)
    assert "micro-batch: 2 of 3 (gradient accumulation)" in text.splitlines()
    assert text.splitlines()[0] == render_verdict(r)[0]
    one = Report(run_id="x", rank=0, step=1, requested_step=1, phase="forward",
                 evidence={"micro_batch": 0, "micro_losses": [float("nan")]})
    assert "micro-batch" not in render_text(one)


def test_one_renderer_three_formats() -> None:
    r = Report(run_id="r", rank=0, step=2, requested_step=2, phase="forward", module="m", module_type="<lambda>")
    title, text = render_verdict(r)
    assert render_verdict(r, "html") == (title, format_body(text, "html"))
    assert "&lt;lambda&gt;" in render_verdict(r, "html")[1] and "<lambda>" not in render_verdict(r, "html")[1]
    assert render_verdict(r, "markdown")[1] == "```\n" + text.rstrip("\n") + "\n```\n"


def test_sample_rows_are_compressed_to_ranges() -> None:
    # the demo's verdict printed all 64 row numbers of its batch on one line
    assert rows_text(list(range(64))) == "[0..63] (64 rows)"
    assert rows_text([3]) == "[3]"
    assert rows_text([1, 2, 5]) == "[1, 2, 5]"
    assert rows_text([0, 1, 2, 7, 9, 10, 11, 12]) == "[0..2, 7, 9..12] (8 rows)"
    assert rows_text([]) == "[]"


def test_a_verdict_without_a_module_name_says_where_once() -> None:
    """A NaN made in the root module's own forward (module "") read "module: - (Net), the model's
    own forward (Net)": the type twice and a dash for the module. The places come from the
    localizer itself (replay/localize.py ``_place``), as a replay writes them."""
    from sentineld.replay.localize import _place

    def module_lines(**place: object) -> list[str]:
        r = Report(run_id="r", rank=0, step=3, requested_step=3, phase="forward", op="aten.log", **place)
        return [ln for ln in render_text(r).splitlines() if ln.startswith("module:")]

    assert module_lines(**_place("", "Net")) == ["module: the model's own forward (Net)"]
    assert module_lines(**_place("<CrossEntropyLoss>", None)) == \
        ["module: loss module CrossEntropyLoss, outside the model"]
    assert module_lines(**_place(None, None)) == ["module: loss function, outside the model"]
    assert module_lines(**_place("fc2", "Linear")) == ["module: fc2 (Linear)"]
    root = Report(run_id="r", rank=0, step=3, requested_step=3, phase="forward", op="aten.log", **_place("", "Net"))
    assert render_text(root).splitlines()[0].endswith("went non-finite in forward, in the model's own forward (Net)")


def test_a_sharded_verdict_says_how_it_was_replayed() -> None:
    # The verdict's replayed_as (FSDP2: consolidated or relaunched) was in the JSON only.
    r = Report(run_id="f", rank=1, step=3, requested_step=3, phase="forward", module="fc1", module_type="Linear",
               reproduced=True, ranks=[1], replayed_as="relaunched at world size 2")
    assert "sharded run replayed relaunched at world size 2" in render_text(r).splitlines()
    assert "sharded run" not in render_text(Report(run_id="d", rank=0, step=3, requested_step=3, phase="forward"))
