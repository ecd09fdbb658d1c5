"""What the daemon tells Alertmanager about an incident besides the signature alert
(sentineld.daemon.am_incident): verdict and crash alerts in the run's group, and a run without a
recipe that d9bb298 paged a second time as ``SentineldReplayFailed``."""

from __future__ import annotations

from sentineld.daemon.am_incident import (
    NO_RECIPE,
    crash_alert,
    incident_annotations,
    incident_severity,
    localizes_in_process,
    replayable_without_recipe,
    verdict_may_come,
    no_recipe_outcome,
    verdict_alert,
)
from sentineld.daemon.replay_runner import ReplayOutcome

# The stderr tail the replay subprocess leaves for a run.json without a recipe (replay/engine.py).
NO_RECIPE_REASON = ("sentineld: run r1 recorded no recipe; pass --recipe module:function (a function "
                    "returning sentineld.contracts.recipe.Recipe)")


def test_failed_for_want_of_a_recipe_is_no_recipe():
    out = no_recipe_outcome("r1", None, ReplayOutcome("failed", None, NO_RECIPE_REASON, 0.4, 2))
    assert out.result == NO_RECIPE
    assert "sentineld replay r1 --recipe module:function" in out.reason
    assert (out.elapsed_s, out.exit_code) == (0.4, 2)


def test_other_outcomes_keep_their_result():
    damaged = ReplayOutcome("failed", None, "capture unreadable: truncated file", 0.1, 2)
    assert no_recipe_outcome("r1", None, damaged) is damaged  # a damaged capture still fails
    named = ReplayOutcome("failed", None, "cannot import recipe 'm:f'", 0.1, 2)
    assert no_recipe_outcome("r1", "m:f", named) is named  # a broken recipe is a real failure
    for result in ("refused", "timeout", "localized"):
        o = ReplayOutcome(result, None, "recipe", 0.1, None)
        assert no_recipe_outcome("r1", None, o) is o


def test_incident_annotations_only_for_a_replayable_run_without_recipe():
    assert incident_annotations(None, True, "r1")["replay"].startswith("not run: run r1 gave no recipe")
    assert incident_annotations("m:f", True, "r1") == {}
    assert incident_annotations(None, False, "r1") == {}  # --no-replay: no replay was promised


def test_extra_alerts_share_the_run_label_and_the_incident_severity():
    sev = incident_severity([{"severity": "warning"}, {"severity": "critical"}])
    assert sev == "critical" and incident_severity([]) == "critical"
    assert incident_severity([{"severity": "warning"}]) == "warning"
    v = verdict_alert(run="r1", severity="warning", title="t", body="b", step=7, rank=1, host="h",
                      starts_at=0.0)
    c = crash_alert(run="r1", severity="critical", title="t", body="b", step=7, rank=None, host="h",
                    starts_at=0.0)
    assert v["labels"]["alertname"] == "SentineldReplay" and v["labels"]["run"] == "r1"
    assert v["labels"]["severity"] == "warning" and v["annotations"]["rank"] == "1"
    assert c["labels"]["alertname"] == "SentineldCrashed" and "rank" not in c["annotations"]


def test_a_run_that_localizes_in_process_is_not_a_no_recipe_run():
    """attach(loss_fn=) runs give a verdict without a recipe: no "not run" annotation, and their
    failed localization (sentineld/daemon/inprocess.py's fallback reason names the recipe) is
    still delivered as a failure, not swallowed as no_recipe."""
    assert localizes_in_process({"localize": "full"}) and not localizes_in_process({"localize": "off"})
    assert not localizes_in_process({}) and not localizes_in_process(None)
    assert incident_annotations(None, True, "r1", in_process=True) == {}
    failed = ReplayOutcome("failed", None, "the training process's localization failed: boom; the run "
                           "named no recipe, so the daemon cannot replay it (pass recipe= to attach)", 0.0, None)
    assert no_recipe_outcome("r1", None, failed, in_process=True) is failed


def test_a_run_whose_model_class_imports_gets_a_forward_only_verdict_not_no_recipe():
    """Since main's forward-only replay, a run without recipe whose model class is importable gets
    a verdict: no "not run" annotation, and a failure of that replay is delivered."""
    assert replayable_without_recipe({"model_class": "pkg.models:Net"})
    assert not replayable_without_recipe({"model_class": "__main__:Net"}) and not replayable_without_recipe({})
    assert verdict_may_come({"model_class": "pkg.models:Net", "localize": "off"})
    assert not verdict_may_come({"model_class": "__main__:Net", "localize": "off"})
    assert incident_annotations(None, True, "r1", in_process=verdict_may_come({"model_class": "m:N"})) == {}
