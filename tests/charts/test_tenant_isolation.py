"""What the chart renders to keep tenants apart: the tenants' ValidatingAdmissionPolicy (where
the API server serves one, in the version it serves). What the policy admits and refuses is
shown on a real API server (tests/node/test_tenant_policy.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.charts.rendering import find, render
from tests.charts.test_kubernetes_schemas import validate_builtin
from tests.charts.tools import CHART, run, tool

V1 = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
V1BETA1 = "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy"
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def _policy_objects(*apis: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [o for o in render(api_versions=apis, sets=sets) if o["kind"] in POLICY_KINDS]


@pytest.mark.parametrize(
    ("apis", "version"),
    [
        ((), None),  # Kubernetes 1.28 and 1.29 as they come: the API is off
        ((V1BETA1,), "v1beta1"),  # 1.28/1.29 with the feature gate and runtime-config
        ((V1, V1BETA1), "v1"),
        ((V1,), "v1"),
    ],
)
def test_the_policy_renders_in_the_version_the_api_server_serves(
    apis: tuple[str, ...], version: str | None
) -> None:
    objects = _policy_objects(*apis)
    if version is None:
        assert objects == []
        return
    assert {o["kind"] for o in objects} == POLICY_KINDS
    assert {o["apiVersion"] for o in objects} == {f"admissionregistration.k8s.io/{version}"}
    errors = {o["kind"]: validate_builtin(o) for o in objects}
    assert errors == dict.fromkeys(POLICY_KINDS), errors


def test_the_policy_is_off_with_its_value() -> None:
    assert _policy_objects(V1, sets=("tenantPolicy.enabled=false",)) == []


def test_the_policy_holds_pods_and_ephemeral_containers() -> None:
    policy = find(tuple(_policy_objects(V1)), "ValidatingAdmissionPolicy")
    rules = {
        (resource, operation)
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
        for resource in rule["resources"]
        for operation in rule["operations"]
    }
    assert rules == {("pods", "CREATE"), ("pods/ephemeralcontainers", "UPDATE")}
    assert policy["spec"]["failurePolicy"] == "Fail"


def _variable(policy: dict[str, Any], name: str) -> str:
    [expression] = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == name]
    return str(expression)


def test_the_only_hostpaths_are_the_namespaces_regions_under_region_root() -> None:
    policy = find(
        tuple(_policy_objects(V1, sets=("regionRoot=/mnt/kv",))), "ValidatingAdmissionPolicy"
    )
    assert _variable(policy, "regionDirectories") == "'/mnt/kv/' + request.namespace + '/'"


def test_the_apparmor_fields_are_checked_where_pods_have_them() -> None:
    """appArmorProfile came with Kubernetes 1.30 (and the v1 API): checked there, and on 1.28
    and 1.29 (v1beta1) only the annotations, which a misspelt field would not type-check."""
    v1 = find(tuple(_policy_objects(V1)), "ValidatingAdmissionPolicy")
    v1beta1 = find(tuple(_policy_objects(V1BETA1)), "ValidatingAdmissionPolicy")
    assert "appArmorProfile" in _variable(v1, "appArmor")
    assert "appArmorProfile" not in _variable(v1beta1, "appArmor")
    annotation = "container.apparmor.security.beta.kubernetes.io/"
    assert annotation in _variable(v1, "appArmor") and annotation in _variable(v1beta1, "appArmor")


def test_every_variable_is_checked_by_a_validation() -> None:
    policy = find(tuple(_policy_objects(V1)), "ValidatingAdmissionPolicy")
    helpers = {"containers", "regionDirectories", "podRunsAsNonRoot", "podSeccomp"}
    rules = {v["name"] for v in policy["spec"]["variables"]} - helpers
    checked = {
        match
        for validation in policy["spec"]["validations"]
        for match in re.findall(r"^size\(variables\.(\w+)\) == 0$", validation["expression"])
    }
    assert checked == rules
    assert len(policy["spec"]["validations"]) == len(rules)


def test_the_binding_selects_tenants_but_never_the_charts_namespace() -> None:
    # helm merges maps with the defaults: null removes the default label
    team = {"key": "team", "operator": "In", "values": ["ml"]}
    selector = json.dumps({"matchLabels": None, "matchExpressions": [team]})
    sets = (f"tenantPolicy.namespaceSelector={selector}",)
    binding = find(tuple(_policy_objects(V1, sets=sets)), "ValidatingAdmissionPolicyBinding")
    namespaces = binding["spec"]["matchResources"]["namespaceSelector"]
    assert namespaces == {
        "matchExpressions": [
            team,
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kvshm-system"]},
        ]
    }
    default = find(tuple(_policy_objects(V1)), "ValidatingAdmissionPolicyBinding")
    assert default["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kvshm.dev/tenant": "true"
    }
    assert default["spec"]["validationActions"] == ["Deny"]


def test_an_empty_namespace_selector_is_refused_saying_why() -> None:
    """An empty selector binds every namespace, kube-system's daemons' too (with no keys at all
    the schema refuses it: test_lint.py)."""
    empty = json.dumps({"matchLabels": None, "matchExpressions": []})
    result = run(
        tool("helm"), "template", str(CHART), "--api-versions", V1,
        "--set-json", f"tenantPolicy.namespaceSelector={empty}",
    )  # fmt: skip
    assert result.returncode != 0
    assert "tenantPolicy.namespaceSelector is empty" in result.stderr, result.stderr
