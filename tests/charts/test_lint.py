"""helm lint --strict over the chart with every example values file, and the values schema."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.charts.rendering import EXAMPLE_VALUES, helm_args, values_id
from tests.charts.tools import CHART, run, tool


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_helm_lint_strict(values: Path | None) -> None:
    result = run(tool("helm"), "lint", "--strict", str(CHART), *helm_args(values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_there_is_an_example_for_gpu_and_for_kind_clusters() -> None:
    assert {p.stem for p in EXAMPLE_VALUES if p is not None} >= {
        "values-production",
        "kind-values",
    }


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [
        ("agent.port=0", "agent.port"),
        ("agent.capabilities={SYS_ADMIN}", "agent.capabilities"),
        ("agent.hostPid=true", "hostPid"),  # a typo: unknown keys are rejected
        ("regionRoot=relative/path", "regionRoot"),
        ("monitoring.prometheusRule.regionFailedFor=5 minutes", "regionFailedFor"),
        ("monitoring.prometheusRule.rootFreeRatio=2", "rootFreeRatio"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        # values the API server would refuse (or the agent would): caught before install
        ("agent.updateStrategy.maxUnavailable=0%", "maxUnavailable"),  # must be positive
        ("regionRoot=/dev/shm/../kvshm", "regionRoot"),  # no '..' in a hostPath
        ("regionRoot=/dev/shm/./kvshm", "regionRoot"),
        ("regionRoot=/mnt/kvshm/", "regionRoot"),  # paths are built from it as written
        ("regionRoot=/dev/shm/", "regionRoot"),
        ("nameOverride=KVSHM", "nameOverride"),  # object names are DNS labels
        ("fullnameOverride=kv_shm", "fullnameOverride"),
        ("agent.resources.requests.memory=1.2.3", "agent.resources.requests.memory"),
        ("operator.resources.limits.cpu=2 cores", "operator.resources.limits.cpu"),
        ("tenantPolicy.validationActions={Allow}", "validationActions"),
        ("tenantPolicy.namespaceSelector.matchLabels=null", "namespaceSelector"),  # selects all
        ("networkPolicy.metricsFrom[0].podSelectr.app=prometheus", "podSelectr"),
    ],
)
def test_values_schema_rejects_bad_values_naming_them(bad: str, complaint: str) -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", bad)
    assert result.returncode != 0, f"--set {bad} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [
        # one Service port twice
        (
            "operator.healthPort=9465",
            "operator.healthPort and operator.metricsPort are both 9465",
        ),
        # mode 1777: the agent refuses a root that others can write
        ("regionRoot=/dev/shm", "Use a directory of its own below it, e.g. /dev/shm/kvshm"),
    ],
)
def test_chart_refuses_values_the_schema_cannot_express_saying_what_to_do(
    bad: str, complaint: str
) -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", bad)
    assert result.returncode != 0, f"--set {bad} was accepted"
    assert complaint in result.stderr, result.stderr


@pytest.mark.parametrize(
    "good",
    [
        "regionRoot=/mnt/.kvshm",  # dots inside a name are fine
        "agent.updateStrategy.maxUnavailable=10%",
        "agent.resources.requests.memory=1e9",
        "agent.resources.requests.cpu=0.5",
        "operator.healthPort=8081",
    ],
)
def test_valid_values_stay_accepted(good: str) -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", good)
    assert result.returncode == 0, result.stderr


def test_every_value_is_described_by_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def undescribed(node: object, schema_node: dict[str, object], path: str) -> list[str]:
        if not isinstance(node, dict) or schema_node.get("type") != "object":
            return []
        properties = schema_node.get("properties")
        if not isinstance(properties, dict):  # free-form maps (labels, affinity)
            return []
        missing = [f"{path}{key}" for key in node if key not in properties]
        for key, child in node.items():
            if key in properties:
                missing += undescribed(child, properties[key], f"{path}{key}.")
        return missing

    assert undescribed(values, schema, "") == []


def test_packaged_chart_holds_crds_and_dashboards_but_not_examples(tmp_path: Path) -> None:
    result = run(tool("helm"), "package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    [package] = tmp_path.glob("kvshm-*.tgz")
    with tarfile.open(package) as archive:
        names = set(archive.getnames())
    assert {"kvshm/crds/offloadregions.kvshm.dev.yaml", "kvshm/values.schema.json"} <= names
    assert {f"kvshm/dashboards/{d}.json" for d in ("node", "regions", "transfers")} <= names
    assert not [n for n in names if n.startswith("kvshm/ci/")]
