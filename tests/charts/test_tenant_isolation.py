"""What the chart renders to keep tenants apart: the tenants' ValidatingAdmissionPolicy (where
the API server serves one, in the version it serves) and the NetworkPolicies of the agent's and
operator's ports. What the policy admits and refuses is shown on a real API server
(tests/node/test_tenant_policy.py); no network plugin here enforces a NetworkPolicy (docs/deploy.md,
"Metrics and the network"), so what these admit is checked against the pods as rendered."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvshm.api.address import is_dns_subdomain
from tests.charts.rendering import find, render
from tests.charts.test_kubernetes_schemas import validate_builtin
from tests.charts.tools import CHART, run, tool

V1 = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
V1BETA1 = "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy"
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def _policy_objects(*apis: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [  # the tenants': the agent's own-node policy renders beside it on 1.30+
        o
        for o in render(api_versions=apis, sets=sets)
        if o["kind"] in POLICY_KINDS
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "tenant-policy"
    ]


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


def _cel_concatenation(expression: str, namespace: str) -> str:
    """The value of a CEL expression that joins single-quoted string literals and
    request.namespace with +, as the policy builds its region-directory pattern."""
    token = re.compile(r"\s*(?:'((?:[^'\\]|\\.)*)'|(request\.namespace))\s*(\+|$)")
    parts, position = [], 0
    while position < len(expression):
        found = token.match(expression, position)
        assert found, f"not a concatenation at {expression[position:]!r}"
        literal, is_namespace, _ = found.groups()
        parts.append(namespace if is_namespace else re.sub(r"\\(.)", r"\1", literal))
        position = found.end()
    return "".join(parts)


def _admits_host_path(root: str, path: str, namespace: str = "serving") -> bool:
    """Whether the policy rendered with this regionRoot admits a hostPath of `path` in the
    namespace: its pattern, matched as CEL's matches() does (RE2, unanchored; RE2's $ is
    Python's \\Z: no match before a trailing newline)."""
    policy = find(
        tuple(_policy_objects(V1, sets=(f"regionRoot={root}",))), "ValidatingAdmissionPolicy"
    )
    pattern = _cel_concatenation(_variable(policy, "regionDirectory"), namespace)
    assert pattern.endswith("$"), pattern
    return re.search(pattern.removesuffix("$") + r"\Z", path) is not None


# a root with a regex metacharacter: quoted, '.' matches only '.'
ROOT = "/mnt/kv.d"


@pytest.mark.parametrize(
    "path",
    [f"{ROOT}/serving/llama-70b-kv", f"{ROOT}/serving/llama-70b-kv/", f"{ROOT}/serving/a.b-c.d"],
)
def test_a_hostpath_of_a_region_directory_of_the_namespace_is_admitted(path: str) -> None:
    assert _admits_host_path(ROOT, path)


@pytest.mark.parametrize(
    "path",
    [
        f"{ROOT}/serving/llama-70b-kv/vllm_offload_llama-70b-kv.mmap",  # a region file
        f"{ROOT}/serving/llama-70b-kv/escape",  # what a tenant may make a symlink
        f"{ROOT}/serving/llama-70b-kv/sub/dir",
        f"{ROOT}/serving/llama-70b-kv//",
        f"{ROOT}/serving",  # the namespace's directory
        f"{ROOT}/serving/",
        f"{ROOT}",
        f"{ROOT}/serving/../../etc",
        f"{ROOT}/serving/..",
        f"{ROOT}/serving/.",
        f"{ROOT}/serving/./llama-70b-kv",
        f"{ROOT}//serving/llama-70b-kv",
        f"{ROOT}/serving//llama-70b-kv",
        f"{ROOT}/serving-b/llama-70b-kv",  # a namespace whose name starts with the tenant's
        f"{ROOT}/other/llama-70b-kv",
        "/mnt/kvXd/serving/llama-70b-kv",  # the root's '.' is quoted
        f"/host{ROOT}/serving/llama-70b-kv",  # anchored at the start
        "serving/llama-70b-kv",
        f"{ROOT}/serving/llama-70b-kv\n",  # anchored at the end
    ],
)
def test_any_other_hostpath_is_refused(path: str) -> None:
    assert not _admits_host_path(ROOT, path)


@pytest.mark.parametrize(
    "name",
    ["a", "0", "a.b", "a-b", "a--b.c9", "-a", "a-", "a..b", ".a", "a.", "A", "a_b", "a b", "a.-b"],
)
def test_the_region_name_in_a_hostpath_follows_the_offloadregion_name_rule(name: str) -> None:
    """An OffloadRegion's name is a DNS subdomain (kvshm.api.address): a region directory has
    no other name, and none of these is '.' or '..'."""
    assert _admits_host_path(ROOT, f"{ROOT}/serving/{name}") == is_dns_subdomain(name)


def test_a_root_with_quotes_and_backslashes_is_written_into_cel_as_written() -> None:
    root = "/mnt/it's\\kv"
    assert _admits_host_path(root, f"{root}/serving/r1")
    assert not _admits_host_path(root, "/mnt/its/serving/r1")
    policy = find(
        tuple(_policy_objects(V1, sets=(f"regionRoot={root}",))), "ValidatingAdmissionPolicy"
    )
    # what the refusal names
    assert _cel_concatenation(_variable(policy, "namespaceDirectory"), "t") == f"{root}/t/"


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
    helpers = {
        "containers",
        "namespaceDirectory",
        "regionDirectory",
        "podRunsAsNonRoot",
        "podSeccomp",
    }
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


# -- NetworkPolicies -------------------------------------------------------------------------


def _pods_by_component(objects: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """component -> the pod template (or pod) of the agent, the operator and helm test."""
    pods = {}
    for obj in objects:
        if obj["kind"] in ("DaemonSet", "Deployment", "Pod"):
            template = obj if obj["kind"] == "Pod" else obj["spec"]["template"]
            pods[template["metadata"]["labels"]["app.kubernetes.io/component"]] = template
    return pods


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart's selectors use no expressions
    return bool(selector["matchLabels"].items() <= labels.items())


def _admitted(policy: dict[str, Any], port: int, pod_labels: dict[str, str], namespace: str,
              namespace_labels: dict[str, str]) -> bool:  # fmt: skip
    """Whether the NetworkPolicy admits a pod so labelled, in a namespace so labelled, to port."""
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule["from"]:
            if "ipBlock" in peer:
                continue
            in_namespace = (
                _selects(peer["namespaceSelector"], namespace_labels)
                if "namespaceSelector" in peer
                else namespace == "kvshm-system"
            )
            if in_namespace and _selects(peer.get("podSelector", {"matchLabels": {}}), pod_labels):
                return True
    return False


def test_each_component_port_admits_prometheus_and_helm_test_only() -> None:
    objects = render()
    pods = _pods_by_component(objects)
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    tenant = {"kubernetes.io/metadata.name": "serving", "kvshm.dev/tenant": "true"}
    test_pod = pods["test"]["metadata"]["labels"]
    for component in ("agent", "operator"):
        policy = find(objects, "NetworkPolicy", f"-{component}")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert _selects(policy["spec"]["podSelector"], pods[component]["metadata"]["labels"])
        ports = {
            port["name"]: port["containerPort"]
            for container in pods[component]["spec"]["containers"]
            for port in container.get("ports", [])
        }
        assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} == set(
            ports.values()
        )
        for name, port in ports.items():
            assert _admitted(policy, port, test_pod, "kvshm-system", {}), (component, name)
            # a tenant's pod that calls itself Prometheus is not Prometheus
            assert not _admitted(policy, port, prometheus, "serving", tenant), (component, name)
            assert not _admitted(policy, port, {}, "kvshm-system", {}), (component, name)
            scraped = name == "metrics"
            assert _admitted(policy, port, prometheus, "monitoring", monitoring) == scraped


def test_no_rule_admits_everyone_even_with_no_scrapers() -> None:
    """An empty `from` admits every source: helm test's pod is always in it."""
    sets = ("networkPolicy.metricsFrom=[]", "tests.enabled=false")
    for policy in (o for o in render(sets=sets) if o["kind"] == "NetworkPolicy"):
        assert all(rule.get("from") for rule in policy["spec"]["ingress"]), policy


def test_the_default_scrapers_are_confined_to_a_namespace() -> None:
    for peer in find(render(), "NetworkPolicy", "-agent")["spec"]["ingress"][0]["from"]:
        assert "namespaceSelector" not in peer or peer["namespaceSelector"]["matchLabels"]


def test_the_network_policies_are_off_with_their_value() -> None:
    objects = render(sets=("networkPolicy.enabled=false",))
    assert [o for o in objects if o["kind"] == "NetworkPolicy"] == []


def test_neither_component_uses_the_host_network() -> None:
    """A NetworkPolicy does not apply to a pod on the host network."""
    pods = _pods_by_component(render())
    assert not any(pods[c]["spec"].get("hostNetwork") for c in ("agent", "operator"))
