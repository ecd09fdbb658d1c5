"""The first alert of an incident is filled in (issue 10, Messages): on d9bb298 it carried the
generic checklist with ``sentineld replay <run> --step N`` left as written and the causes in a
fixed order. It must name the run, the step and the exact command, and order the likely causes
by what the step showed."""

from __future__ import annotations

import pytest

from sentineld.daemon.messages import CAUSES, alert_text, nonfinite_causes
from sentineld.signatures.numerics import DATA_NONFINITE_FIX, LOSS_SCALE_FIX, NONFINITE_FIX

NAN, INF = float("nan"), float("inf")


def _alert(numbers: dict, message: str = "non-finite loss=nan at step 12", run_dir: str = "/data/runs/exp 1"):
    return alert_text("exp1", [1, 0], "nonfinite", "critical", 12, message, numbers, NONFINITE_FIX,
                      host="gpu3", run_dir=run_dir)


def test_alert_names_run_step_and_the_exact_command() -> None:
    title, body = _alert({"loss": NAN, "grad_norm": NAN})
    assert title == "[sentineld] CRITICAL nonfinite in run exp1 at step 12"
    lines = body.splitlines()
    assert "run: exp1  rank(s): 0,1  step: 12  severity: critical  host: gpu3" in lines
    assert "replay step 12: sentineld replay '/data/runs/exp 1' --step 12" in lines
    assert "<run>" not in body and "--step N" not in body
    assert "likely causes, from what was seen:" in lines


@pytest.mark.parametrize(("numbers", "message", "first"), [
    ({"loss": NAN, "grad_norm": NAN, "lr": INF}, "non-finite learning rate lr=inf at step 12", "lr_nonfinite"),
    ({"loss": 2.3, "grad_norm": INF}, "non-finite grad_norm=inf at step 12", "explosion"),
    ({"loss": 2.3, "grad_norm": NAN}, "non-finite grad_norm=nan at step 12", "grad_zero_div"),
    ({"loss": 2.3, "grad_norm": 1.5}, "non-finite parameters at step 12", "optimizer"),
    ({"loss": INF, "grad_norm": NAN}, "non-finite loss=inf, grad_norm=nan at step 12", "div_log"),
    ({"loss": "nan", "grad_norm": "nan"}, "non-finite loss=nan at step 12", "div_log"),  # as JSON strings
    ({"loss": NAN, "grad_norm": NAN}, "non-finite loss=nan, input batch at step 12", "data"),
])
def test_likely_causes_follow_what_was_seen(numbers: dict, message: str, first: str) -> None:
    order = nonfinite_causes(numbers, message)
    assert order[0] == first and sorted(order) == sorted(CAUSES)
    body = _alert(numbers, message)[1]
    assert f"  1. {CAUSES[first]}" in body.splitlines()


def test_other_signatures_keep_their_fix_with_the_run_filled_in() -> None:
    _t, body = alert_text("exp1", [0], "loss_scale_collapse", "critical", 40, "scale fell", {"loss_scale": 0.5},
                          LOSS_SCALE_FIX, run_dir="/runs/exp1")
    assert f"fix: {LOSS_SCALE_FIX}" in body.splitlines() and "replay step" not in body
    _t, body = alert_text("exp1", [0], "nonfinite", "critical", 3, "non-finite input batch at step 3",
                          {"loss": NAN}, DATA_NONFINITE_FIX, run_dir="/runs/exp1")
    assert f"fix: {DATA_NONFINITE_FIX}" in body and "replay step 3: sentineld replay /runs/exp1 --step 3" in body
    _t, body = alert_text("exp1", [0], "divergence", "warning", 3, "m", {}, "see sentineld replay <run> --step N",
                          run_dir="/runs/exp1")
    assert "fix: see sentineld replay /runs/exp1 --step 3" in body


def test_alert_says_whether_a_verdict_follows() -> None:
    _t, body = alert_text("exp1", [0], "nonfinite", "critical", 4, "non-finite loss=nan at step 4", {"loss": NAN},
                          NONFINITE_FIX, run_dir="/runs/exp1", replay_note="automatic replay: on")
    lines = body.splitlines()
    assert lines[lines.index("replay step 4: sentineld replay /runs/exp1 --step 4") + 1] == "automatic replay: on"
