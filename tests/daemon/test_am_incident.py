"""What the daemon tells Alertmanager about an incident besides the signature alert
(sentineld.daemon.am_incident): verdict and crash alerts in the run's group, and a run without a
recipe that d9bb298 paged a second time as ``SentineldReplayFailed``."""

from __future__ import annotations

import json
from types import SimpleNamespace

from sentineld.daemon.am_incident import (
    NO_RECIPE,
    crash_alert,
    incident_annotations,
    incident_severity,
    localizes_in_process,
    no_recipe_outcome,
    replayable_without_recipe,
    verdict_alert,
    verdict_may_come,
)
from sentineld.daemon.replay_runner import ReplayOutcome

# The stderr tail the replay subprocess leaves for a run.json without a recipe (replay/engine.py).
NO_RECIPE_REASON = ("sentineld: run r1 recorded no recipe; pass --recipe module:function (a function "
                    "returning sentineld.recipe.Recipe)")


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


def _notifier(tmp_path, clock):
    from sentineld.daemon.alertmanager import DAEMON_HOLD_S
    from sentineld.daemon.am_active import ActiveAlerts
    from sentineld.daemon.notifier import Notifier
    from sentineld.daemon.outbox import Outbox

    return Notifier(Outbox(tmp_path / "outbox"), [], clock, ActiveAlerts(resend_s=60.0, hold_s=DAEMON_HOLD_S,
                                                                       clock=clock),
                    extras_path=tmp_path / "am_extras.json", host="node-a")


def test_verdict_and_crash_alerts_survive_a_restart_through_the_state_dir(tmp_path):
    """What a restarted daemon re-sends: the last one's firing verdict/crash alerts, exactly
    (labels, annotations, startsAt); not its signature alerts (run progress restores those)."""
    now = [1_790_000_000.0]
    first = _notifier(tmp_path, lambda: now[0])
    rw = SimpleNamespace(run_id="r1", active={}, meta=None)
    first.am_extra(rw, "replay", "[sentineld] replay of run r1 step 7: non-finite input data", "phase: data\n", 7, 1)
    first.am_extra(rw, "crashed", "[sentineld] CRITICAL run r1 crashed", "boom\n", 9, 0)
    kept = json.loads((tmp_path / "am_extras.json").read_text())
    assert sorted(a["labels"]["alertname"] for a in kept) == ["SentineldCrashed", "SentineldReplay"]
    assert all(a["labels"]["host"] == "node-a" for a in kept)

    now[0] += 3600
    second = _notifier(tmp_path, lambda: now[0])
    assert second.restore_extras() == 2
    due = {a["labels"]["alertname"]: a for a in second.am.due()}
    assert {k: (a["labels"], a["annotations"], a["startsAt"]) for k, a in due.items()} == {
        a["labels"]["alertname"]: (a["labels"], a["annotations"], a["startsAt"]) for a in kept}
    # They resolve with their incident, as if the daemon had never restarted.
    second.am_resolve_extras(rw)
    assert {a["labels"]["alertname"]: a["endsAt"] for a in second.am.due()} == {
        "SentineldCrashed": "2026-09-21T15:13:20.000Z", "SentineldReplay": "2026-09-21T15:13:20.000Z"}
    assert json.loads((tmp_path / "am_extras.json").read_text()) == []


def test_a_damaged_extras_file_restores_nothing_and_the_daemon_goes_on(tmp_path, caplog):
    n = _notifier(tmp_path, lambda: 1_790_000_000.0)
    assert n.restore_extras() == 0  # no file yet: a first start
    (tmp_path / "am_extras.json").write_text("{not json")
    assert n.restore_extras() == 0 and "not restored" in caplog.text
    (tmp_path / "am_extras.json").write_text(json.dumps([
        {"labels": {"alertname": "SentineldNonfinite", "signature": "nonfinite", "run": "r1"}},  # progress's
        {"labels": {"signature": "replay"}}, "junk", {"labels": "x"}]))
    assert n.restore_extras() == 0 and len(n.am) == 0

