"""The chart's alerting rules: valid for promtool, unit-tested with `promtool test rules`, every
alert covered by a firing case, and built only from the metrics contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.charts.rendering import EXAMPLE_VALUES, find, render, values_id
from tests.charts.tools import run, tool
from tests.monitoring.rules import (
    contract_metrics,
    names_in,
    rule_groups,
    series_names,
    write_rule_file,
)

ALERT_TESTS = sorted((Path(__file__).parent / "alerts").glob("*_test.yaml"))


def _promtool_test(tmp_path: Path, test_file: Path, sets: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run one unit-test file against the rules rendered with `sets`."""
    rules = write_rule_file(tmp_path, sets)
    test = yaml.safe_load(test_file.read_text())
    test["rule_files"] = [str(rules)]
    bound = tmp_path / test_file.name
    bound.write_text(yaml.safe_dump(test, sort_keys=False))
    result = run(tool("promtool"), "test", "rules", str(bound), timeout=120)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_promtool_check_rules(values: Path | None, tmp_path: Path) -> None:
    # the kind example turns rules off; check what it would render when turned on
    objects = render(values, monitoring=True, sets=("monitoring.prometheusRule.enabled=true",))
    groups = find(objects, "PrometheusRule")["spec"]["groups"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(group['rules']) for group in groups)} rules found" in result.stdout


@pytest.mark.parametrize("test_file", ALERT_TESTS, ids=lambda p: p.stem)
def test_promtool_test_rules(test_file: Path, tmp_path: Path) -> None:
    code, output = _promtool_test(tmp_path, test_file)
    assert code == 0, output
    assert "SUCCESS" in output


def test_unit_tests_notice_a_changed_rule(tmp_path: Path) -> None:
    """The unit tests pin the rules' timing: a different `for` must make them fail."""
    alerts_test = next(p for p in ALERT_TESTS if p.stem == "alerts_test")
    code, output = _promtool_test(
        tmp_path, alerts_test, ("monitoring.prometheusRule.regionFailedFor=3m",)
    )
    assert code != 0 and "KvshmRegionsFailed" in output


def test_every_alert_has_a_firing_case() -> None:
    fired: set[str] = set()
    for test_file in ALERT_TESTS:
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    alerts = {rule["alert"] for group in rule_groups() for rule in group["rules"]}
    assert alerts == fired
    assert {
        "KvshmRegionsFailed",
        "KvshmRegionsDegraded",
        "KvshmNodeRootNearlyFull",
        "KvshmOrphanedBytesGrowing",
        "KvshmAgentDown",
        "KvshmInventoryCapped",
        "KvshmPopulateSlow",
    } <= alerts


def test_alerts_use_only_contract_metrics() -> None:
    known = series_names(contract_metrics())
    for group in rule_groups():
        for rule in group["rules"]:
            used = names_in(rule["expr"])
            assert used, f"{rule['alert']} uses no metric"
            assert used <= known, f"{rule['alert']}: {sorted(used - known)} not in docs/metrics.md"


def test_alert_thresholds_follow_values() -> None:
    sets = ("monitoring.prometheusRule.rootFreeRatio=0.25", "agent.resyncSeconds=10")
    exprs = {r["alert"]: r["expr"] for g in rule_groups(sets) for r in g["rules"]}
    assert exprs["KvshmNodeRootNearlyFull"].rstrip().endswith("< 0.25")
    assert exprs["KvshmAgentStalled"].rstrip().endswith("> 50")
