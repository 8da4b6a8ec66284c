"""Every rendered object is valid: built-in kinds against the Kubernetes 1.32 OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), Prometheus Operator kinds against validators
generated from that operator's CRD schemas. (kvshm's own CRDs: test_crds.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.charts.rendering import EXAMPLE_VALUES, render, values_id
from tests.charts.tools import TOOLS, run, tool

KUBERNETES_VERSION = "1.32.0"  # the kubectl on the machine; the chart supports >= 1.28
MONITORING_GROUP = "monitoring.coreos.com/v1"
MONITORING_MODELS = TOOLS / "node" / "node_modules" / "@kubernetes-models" / "prometheus-operator"


def validate_builtin(obj: dict[str, Any]) -> str | None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{exc.message} at {list(exc.absolute_path)}"
    return None


@pytest.mark.parametrize("monitoring", [True, False], ids=["with-monitoring-api", "without"])
@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_rendered_builtin_objects_are_valid(values: Path | None, monitoring: bool) -> None:
    objects = render(values, monitoring=monitoring, include_crds=True)
    builtin = [o for o in objects if o["apiVersion"] != MONITORING_GROUP]
    errors = {
        f"{o['kind']}/{o['metadata']['name']}": error
        for o in builtin
        if (error := validate_builtin(o)) is not None
    }
    assert errors == {}
    kinds = {o["kind"] for o in builtin}
    assert {"DaemonSet", "Deployment", "ClusterRole", "Service"} <= kinds


def test_validation_is_strict() -> None:
    """A misspelt field must fail, or the test above proves little."""
    daemonset = next(o for o in render() if o["kind"] == "DaemonSet")
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    assert validate_builtin(broken) is not None


def _validate_monitoring(objects: list[dict[str, Any]]) -> tuple[int, str]:
    result = run(
        "node",
        str(Path(__file__).with_name("validate_monitoring.mjs")),
        str(MONITORING_MODELS),
        input=json.dumps(objects),
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_rendered_monitoring_objects_are_valid(values: Path | None) -> None:
    tool("node")
    if not MONITORING_MODELS.is_dir():
        pytest.fail(f"{MONITORING_MODELS} is missing: run scripts/install-tools.sh")
    objects = [o for o in render(values, monitoring=True) if o["apiVersion"] == MONITORING_GROUP]
    code, output = _validate_monitoring(objects)
    assert code == 0, output


def test_monitoring_objects_need_the_api_and_the_flag() -> None:
    def kinds(**kwargs: Any) -> set[str]:
        return {o["kind"] for o in render(**kwargs) if o["apiVersion"] == MONITORING_GROUP}

    assert kinds(monitoring=True) == {"ServiceMonitor", "PrometheusRule"}
    assert kinds(monitoring=False) == set()
    off = ("monitoring.serviceMonitor.enabled=false", "monitoring.prometheusRule.enabled=false")
    assert kinds(monitoring=True, sets=off) == set()
    serving = ("monitoring.servingPodMonitor.enabled=true",)
    assert "PodMonitor" in kinds(monitoring=True, sets=serving)


def test_monitoring_validation_catches_a_bad_duration() -> None:
    rule = next(o for o in render() if o["kind"] == "PrometheusRule")
    broken = json.loads(json.dumps(rule))
    broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    code, output = _validate_monitoring([broken])
    assert code != 0 and "for" in output
