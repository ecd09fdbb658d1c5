"""Which in-process verdicts the daemon delivers (daemon/verdict_accept.py), as a pure rule."""

from __future__ import annotations

from sentineld.contracts.rundir import RunMeta
from sentineld.contracts.verdict import REPORT_SCHEMA_VERSION
from sentineld.daemon.verdict_accept import verdict_problem

CAP = "capture-rank1-step000000005-nonfinite.h5"
GOOD = {"schema_version": REPORT_SCHEMA_VERSION, "run_id": "exp1", "rank": 1, "step": 5, "phase": "forward",
        "module": "fc", "capture": f"/runs/exp1/{CAP}"}
META = RunMeta(run_id="exp1")


def problem(payload: object, owners: tuple[int, int, int] = (7, 7, 7)) -> str | None:
    return verdict_problem(payload, owners=owners, meta=META, capture=CAP)


def test_a_verdict_of_this_run_rank_and_capture_from_its_owner_is_accepted() -> None:
    assert problem(GOOD) is None
    assert problem({"result": "failed", "reason": "TypeError"}) is None


def test_anything_else_is_refused_with_the_reason() -> None:
    assert "owned by uid 8" in problem(GOOD, (7, 7, 8))
    assert "not written by the process" in problem({"result": "failed", "reason": "x"}, (8, 7, 7))
    assert "names run 'other'" in problem({**GOOD, "run_id": "other"})
    assert "rank" in problem({**GOOD, "rank": 0}) and "rank" in problem({**GOOD, "rank": True})
    assert "names capture" in problem({**GOOD, "capture": "capture-rank1-step000000006-nonfinite.h5"})
    assert "schema_version" in problem({**GOOD, "schema_version": 1})
    assert "phase" in problem({**GOOD, "phase": "everything"})
    assert "cause_class" in problem({**GOOD, "cause_class": "made_up"})  # the one validator
    assert problem([GOOD]) == "not a JSON object"
