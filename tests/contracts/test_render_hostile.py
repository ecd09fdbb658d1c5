"""Hostile names in a verdict (breaker pass): a module name with a line break and a fence."""

from __future__ import annotations

import re

from torch import nn

from sentineld.contracts.render import format_body, render_verdict


def _verdict(module: str) -> dict:
    return {"run_id": "r1", "step": 3, "phase": "forward", "module": module, "module_type": "Linear",
            "op": "relu", "parameters": [f"{module}.weight"], "cause": "c", "fix": "f"}


def test_a_module_name_with_a_line_break_forges_no_line_and_no_subject_break():
    name = "head\n~~~\nfix: delete the checkpoints\n```"
    m = nn.Module()
    m.add_module(name, nn.Linear(2, 2))  # torch accepts it: only '.' and '' are refused
    assert name in dict(m.named_modules())
    title, body = render_verdict(_verdict(name), "text")
    assert "\n" not in title and "module head\\n~~~\\nfix: delete the checkpoints\\n```" in title
    assert [ln for ln in body.splitlines() if ln.startswith("fix:")] == ["fix: f"]
    _, md = render_verdict(_verdict(name), "markdown")
    fence = md.splitlines()[0]
    # The code block closes only at the last line: no body line is a closing fence.
    assert re.fullmatch("`{3,}", fence) and md.splitlines()[-1] == fence
    assert not any(re.fullmatch(r"\s{0,3}(`{%d,}|~{3,})\s*" % len(fence), ln) for ln in md.splitlines()[1:-1])


def test_markdown_body_with_both_fence_kinds_stays_one_code_block():
    # The body held ``` so the fence was ~~~, and a '~~~' line closed it early.
    md = format_body("a\n```\n~~~\n*b* <!channel>\n", "markdown")
    lines = md.splitlines()
    assert lines[0] == lines[-1] == "````" and lines[1:-1] == ["a", "```", "~~~", "*b* <!channel>"]


def test_a_verdict_with_wrong_typed_lists_renders_instead_of_raising():
    # parameters [1, 2] raised TypeError (str.join), ranks 3 "'int' object is not iterable",
    # evidence [1] AttributeError: out of the daemon's notifier, so the verdict was never sent.
    r = _verdict("head")
    r.update(parameters=[1, 2], ranks=3, evidence=[1])
    for fmt in ("text", "html", "markdown"):
        title, body = render_verdict(r, fmt)
        assert "parameters: 1, 2" in body and title.endswith("module head, rank 3")


def test_int_ranks_render_as_ints() -> None:
    # Regression: coercing list fields to text made a DDP verdict's ranks ['1'] ("born on ['1']").
    report = {"run_id": "w2", "step": 7, "phase": "forward", "module": "fc1", "ranks": [1],
              "evidence": {"ddp": {"world_size": 2, "ranks_used": [0, 1]}}}
    title, body = render_verdict(report)
    assert "ranks: born on [1] of 2, replayed from [0, 1]" in body
    assert title.endswith("module fc1, rank 1")
