"""The Grafana dashboards, without a server: well-formed, every query valid PromQL built only from
the metrics contract, every contract metric shown somewhere, one ConfigMap each in the chart.
(test_prometheus_e2e.py runs every query against a real Prometheus.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.charts.rendering import render
from tests.charts.tools import run, tool
from tests.monitoring.dashboards import DASHBOARDS, load, panels, queries, variable_queries
from tests.monitoring.rules import (
    contract_metrics,
    metric_of_series,
    names_in,
    rule_groups,
    series_names,
)


def test_the_three_dashboards_exist() -> None:
    assert {p.stem for p in DASHBOARDS} == {"node", "regions", "transfers"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path: Path) -> None:
    board = load(path)
    assert board["uid"] == f"kvshm-{path.stem}" and board["title"].startswith("kvshm / ")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        where = f"{path.stem}/{panel['title']}"
        assert panel["datasource"]["uid"] == "${datasource}", where
        assert panel.get("description"), f"{where} has no description"
        assert panel["targets"], f"{where} has no query"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, where
        for target in panel["targets"]:
            assert target["expr"].strip(), where
            assert target["datasource"]["uid"] == "${datasource}", where


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule (it has no bare PromQL check)."""
    found = queries()
    rules = [{"record": f"kvshm:check:{i}", "expr": q.expr} for i, q in enumerate(found)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_queries_use_only_contract_metrics() -> None:
    known = series_names(contract_metrics())
    for query in queries():
        used = names_in(query.expr)
        assert used, f"{query.name} uses no kvshm metric"
        assert used <= known, f"{query.name}: {sorted(used - known)} not in docs/metrics.md"
    for name, metric, _ in variable_queries():
        assert metric in known, name


def test_every_contract_metric_is_on_a_dashboard_or_in_an_alert() -> None:
    metrics = contract_metrics()
    exprs = [q.expr for q in queries()]
    exprs += [rule["expr"] for group in rule_groups() for rule in group["rules"]]
    shown = {metric_of_series(series, metrics) for expr in exprs for series in names_in(expr)}
    assert set(metrics) - shown == set()


@pytest.mark.parametrize(
    ("dashboard", "metrics"),
    [
        (
            "node",
            {
                "kvshm_agent_root_capacity_bytes",
                "kvshm_agent_root_free_bytes",
                "kvshm_agent_regions",
                "kvshm_agent_populate_bytes_total",
                "kvshm_agent_populate_seconds",
                "kvshm_agent_orphaned_bytes",
                "kvshm_agent_reclaims_total",
            },
        ),
        (
            "regions",
            {
                "kvshm_agent_region_phase",
                "kvshm_operator_regions",
                "kvshm_agent_region_populated_bytes",
                "kvshm_agent_region_size_bytes",
                "kvshm_operator_reconciles_total",
            },
        ),
        (
            "transfers",
            {
                "kvshm_transfer_bytes_total",
                "kvshm_transfer_size_bytes",
                "kvshm_transfer_failures_total",
            },
        ),
    ],
)
def test_dashboard_shows_what_it_is_for(dashboard: str, metrics: set[str]) -> None:
    contract = contract_metrics()
    shown = {
        metric_of_series(series, contract)
        for query in queries()
        if query.dashboard == dashboard
        for series in names_in(query.expr)
    }
    assert metrics <= shown


def test_transfers_by_direction_and_size_histogram() -> None:
    transfer = [q for q in queries() if q.dashboard == "transfers"]
    assert any(
        "by (direction)" in q.expr and "kvshm_transfer_bytes_total" in q.expr for q in transfer
    )
    board = load(next(p for p in DASHBOARDS if p.stem == "transfers"))
    assert any(p["type"] == "heatmap" for p in panels(board))


def test_chart_ships_one_labelled_configmap_per_dashboard() -> None:
    configmaps = [
        o
        for o in render()
        if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    shipped = {}
    for configmap in configmaps:
        [(key, text)] = configmap["data"].items()
        shipped[key] = json.loads(text)
    assert shipped == {f"kvshm-{p.name}": load(p) for p in DASHBOARDS}


def test_dashboards_can_be_turned_off_or_relabelled() -> None:
    off = render(sets=("monitoring.dashboards.enabled=false",))
    assert not [o for o in off if o["metadata"]["name"].startswith("kvshm-dashboard")]
    moved = ("monitoring.dashboards.label=grafana_dash", "monitoring.dashboards.namespace=mon")
    relabelled = render(sets=moved)
    boards = [o for o in relabelled if "grafana_dash" in o["metadata"].get("labels", {})]
    assert len(boards) == len(DASHBOARDS)
    assert {b["metadata"]["namespace"] for b in boards} == {"mon"}
