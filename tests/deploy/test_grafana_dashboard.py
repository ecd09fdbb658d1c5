"""deploy/grafana: the dashboard is well formed, wired to the provisioned datasource, and every
query in it parses in a real Prometheus (no Grafana binary exists for this platform here, see
reference/ecosystem-facts.md section 3, so the PromQL is what can be proven)."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from .helpers import (
    DEPLOY,
    PROMETHEUS_BUILTINS,
    Server,
    dashboard,
    http_get,
    promql_metric_names,
    substitute,
    template_variables,
)
from sentineld.contracts import metric_names

GRAFANA = DEPLOY / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "sentineld.yml"


def all_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and label_values() variable."""
    d = dashboard()
    for panel in d["panels"]:
        for t in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {t['refId']}", t["expr"]
    for a in d["annotations"]["list"]:
        if a.get("datasource", {}).get("type") == "prometheus":
            yield f"annotation {a['name']!r}", a["expr"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["definition"])
            assert m, v["definition"]
            yield f"variable {v['name']}", m.group(1)


def test_structure() -> None:
    d = dashboard()
    assert d["uid"] == "sentineld-training"
    assert 39 <= d["schemaVersion"] <= 41
    assert "__inputs" not in d, "exported for sharing externally: provisioning cannot resolve it"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = [p["title"] for p in d["panels"]]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    for p in d["panels"]:
        assert p["type"] in {"timeseries", "stat", "table"}, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert "unit" in p["fieldConfig"]["defaults"], p["title"]
        refids = [t["refId"] for t in p["targets"]]
        assert refids and len(refids) == len(set(refids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), (p["title"], t["refId"])
            assert t["datasource"] == p["datasource"]


def test_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = p["title"]


def test_required_panels_are_there() -> None:
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dashboard()["panels"]}
    for title, metric in {
        "Loss": "sentineld_train_loss",
        "Gradient norm": "sentineld_grad_norm",
        "Learning rate": "sentineld_learning_rate",
        "Step time": "sentineld_step_duration_seconds",
        "Per-layer gradient norms": "sentineld_layer_grad_norm",
        "Dead-ReLU shares": "sentineld_layer_dead_ratio",
        "Update ratios": "sentineld_layer_update_ratio",
        "Loss scale": "sentineld_loss_scale",
        "Non-finite steps": "sentineld_nonfinite_steps_total",
    }.items():
        assert metric in exprs[title], title


def test_variables_and_alert_annotations() -> None:
    v = template_variables()
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name, label in {"host": "host", "run": "run", "rank": "rank", "module": "module"}.items():
        assert v[name]["type"] == "query"
        assert v[name]["definition"].startswith("label_values(")
        assert v[name]["definition"].endswith(f", {label})")
        assert v[name]["datasource"]["uid"] == "${datasource}"
    alerts = [a for a in dashboard()["annotations"]["list"] if "ALERTS" in a.get("expr", "")]
    assert alerts and alerts[0]["enable"]


def test_datasource_uid_matches_provisioning() -> None:
    ds = yaml.safe_load(DATASOURCES.read_text())
    assert ds["apiVersion"] == 1
    (prom,) = [d for d in ds["datasources"] if d["type"] == "prometheus"]
    default = template_variables()["datasource"]["current"]["value"]
    assert prom["uid"] == default
    assert prom["access"] == "proxy"


def test_dashboard_provider() -> None:
    doc = yaml.safe_load(PROVIDERS.read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"]


def test_metric_names_exist() -> None:
    known = set(metric_names.ALL) | PROMETHEUS_BUILTINS
    for where, expr in all_queries():
        used = promql_metric_names(expr)
        assert used, where
        assert used <= known, f"{where} uses {used - known}, not in sentineld/contracts/metric_names.py"


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, start_prometheus: Callable[[Path], Server]
) -> Server:
    config = tmp_path_factory.mktemp("grafana") / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n")
    return start_prometheus(config)


def test_every_query_parses_in_prometheus(prometheus: Server) -> None:
    bad = []
    queries = list(all_queries())
    assert len(queries) >= 20
    for where, expr in queries:
        url = prometheus.url + "/api/v1/query?" + urllib.parse.urlencode({"query": substitute(expr)})
        status, body = http_get(url)
        if status != 200:
            bad.append(f"{where}: {status} {body[:300]!r}")
    assert not bad, "\n".join(bad)


def test_parse_check_is_not_vacuous(prometheus: Server) -> None:
    """Control: a typo in a query does come back as 400 bad_data."""
    url = prometheus.url + "/api/v1/query?" + urllib.parse.urlencode(
        {"query": substitute('rate(sentineld_train_steps_total{run=~"$run"}[$__rate_interval]')}
    )
    status, body = http_get(url)
    assert status == 400 and b"bad_data" in body
