"""deploy/prometheus: promtool accepts config and rules, and rules.test.yml pins every rule.

Beyond running ``promtool test rules``, two mutations per rule prove the unit tests are not
vacuous: a rule that never fires must fail them (each rule has a firing case), and a rule that
fires for every series of its metric must fail them (each rule has a quiet series).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import DEPLOY, PROMETHEUS_BUILTINS, promql_metric_names, require_binary
from sentineld.contracts import metric_names

PROM = DEPLOY / "prometheus"
RULES = PROM / "rules.yml"
RULE_TESTS = PROM / "rules.test.yml"

def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules.yml" in result.stdout  # the rule file was found and checked too


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", "rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", "rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_use_only_exported_metric_names() -> None:
    for rule in alert_rules():
        used = promql_metric_names(rule["expr"])
        assert used, rule["alert"]
        unknown = used - set(metric_names.ALL) - PROMETHEUS_BUILTINS
        assert not unknown, f"{rule['alert']} uses {unknown}, not in sentineld/contracts/metric_names.py"


def test_every_rule_has_severity_annotations_and_runbook() -> None:
    readme = (DEPLOY / "README.md").read_text().lower()
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        ann = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(ann), rule["alert"]
        anchor = rule["alert"].lower()
        assert f"#{anchor}" in ann["runbook"], rule["alert"]
        assert f"### {anchor}" in readme, f"deploy/README.md has no runbook entry for {anchor}"
        # Per-run alerts name their run; scrape and daemon alerts their host or target.
        assert re.search(r"\$labels\.(run|host|instance)", ann["summary"]), rule["alert"]


#: Rules that page what a daemon signature pages (the fallback for runs no daemon watches, or the
#: same condition seen from the metrics): they must route alike, so the severity must agree.
RULE_SIGNATURE = {
    "SentineldLossNonFinite": "nonfinite", "SentineldGradNormNonFinite": "nonfinite",
    "SentineldNonFiniteSteps": "nonfinite", "SentineldLossScaleCollapsed": "loss_scale_collapse",
    "SentineldDeadReLU": "dead_relu", "SentineldTrainingStalled": "stalled",
    "SentineldReplicasDiverged": "replica_divergence",
}


def test_rule_and_daemon_agree_on_severity() -> None:
    """Issue 16: loss_scale_collapse was critical in the daemon and warning in the rule (one
    went to the pager, the other to chat)."""
    from sentineld.signatures.base import SIGNATURES

    rules = {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
    assert set(RULE_SIGNATURE) <= set(rules)
    assert {a: rules[a] for a in RULE_SIGNATURE} == {a: SIGNATURES[s] for a, s in RULE_SIGNATURE.items()}


def test_replica_divergence_has_a_rule_on_the_daemons_signature() -> None:
    """No rule paged the replica_divergence signature (no agent series shows it): a daemon without
    an Alertmanager URL reported it to nobody but its own notify URLs. rules.test.yml fires it from
    the daemon's gauge and keeps it quiet for other runs and other signatures."""
    rules = {r["alert"]: r for r in alert_rules()}
    assert 'signature="replica_divergence"' in rules["SentineldReplicasDiverged"]["expr"]
    assert "sentineld_signature_active" in rules["SentineldReplicasDiverged"]["expr"]
    # Alertmanager mutes it while the daemon's own alert for the run is active (one page)
    from sentineld.daemon.alertmanager import alertname_for

    am = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    assert any(f'alertname="{alertname_for("replica_divergence")}"' in i["source_matchers"]
               and i["target_matchers"] == ['alertname="SentineldReplicasDiverged"'] and i["equal"] == ["run"]
               for i in am["inhibit_rules"])


def test_every_rule_has_unit_tests() -> None:
    tested = {t["alertname"] for g in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in g.get("alert_rule_test", [])}
    assert {r["alert"] for r in alert_rules()} <= tested


def _first_selector(expr: str) -> str:
    """The first series selector of an expression, matchers included (``up{job="x"}``)."""
    m = re.search(r"\b(sentineld_[a-z_]+|up)(\{[^}]*\})?", expr)
    assert m, expr
    return m.group(0)


@pytest.mark.parametrize("mutation", ["never_fires", "fires_for_every_series"])
def test_rule_tests_catch_a_broken_rule(tmp_path: Path, mutation: str) -> None:
    doc = yaml.safe_load(RULES.read_text())
    tests = yaml.safe_load(RULE_TESTS.read_text())
    shutil.copy(RULES, tmp_path / "rules.yml")
    survivors = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            original = rule["expr"]
            rule["expr"] = "vector(1) > 2" if mutation == "never_fires" else _first_selector(original)
            (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
            only_this = {**tests, "tests": [g for g in tests["tests"] if any(
                t["alertname"] == rule["alert"] for t in g.get("alert_rule_test", []))]}
            (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(only_this, sort_keys=False))
            result = promtool("test", "rules", "rules.test.yml", cwd=tmp_path)
            if result.returncode == 0:
                survivors.append(rule["alert"])
            rule["expr"] = original
    assert not survivors, f"rules.test.yml still passes with {mutation} for {survivors}"
