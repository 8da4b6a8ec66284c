"""The CRD files: valid CRDs, structural, every rule compiled by the real API server (tests/envtest)
and helpful, names agree with kvshm.api, printer columns served."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import kubernetes
import kubernetes_validate
import pytest

from kvshm import api
from tests.api.admission import CRD_DOCUMENTS, rules, schema_nodes

CRDS = {crd["spec"]["names"]["kind"]: crd for crd in CRD_DOCUMENTS}


def schema_of(kind: str) -> Mapping[str, Any]:
    schema: Mapping[str, Any] = CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_there_are_the_two_kinds() -> None:
    assert set(CRDS) == {api.REGION_KIND, api.NODE_KIND}


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_the_crd_is_a_valid_apiextensions_v1_object(kind: str) -> None:
    # strict: a misspelt field (x-kubernetes-validation, jsonpath) is an error, not ignored
    kubernetes_validate.validate(CRDS[kind], "1.31", strict=True)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_the_schema_is_structural(kind: str) -> None:
    for path, node in schema_nodes(schema_of(kind)):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and path not in ("", "metadata"):
            assert "properties" in node or "additionalProperties" in node, f"{path} is free-form"


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_every_rule_compiles_and_says_what_to_do(
    kind: str, envtest_admin: kubernetes.client.ApiClient
) -> None:
    """The server compiled (and costed) every rule: it established the CRD holding them all."""
    name = CRDS[kind]["metadata"]["name"]
    served = kubernetes.client.ApiextensionsV1Api(envtest_admin).read_custom_resource_definition(
        name
    )
    conditions = {c.type: c.status for c in served.status.conditions}
    assert conditions["Established"] == conditions["NamesAccepted"] == "True", conditions
    served_schema = envtest_admin.sanitize_for_serialization(served)["spec"]["versions"][0]
    found = rules(schema_of(kind))

    def keyed(found: list[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, str, str]]:
        return sorted((path, rule["rule"], rule.get("message", "")) for path, rule in found)

    assert found and keyed(rules(served_schema["schema"]["openAPIV3Schema"])) == keyed(found)
    for path, rule in found:
        assert len(rule.get("message", "")) > 20, f"{path}: {rule['rule']} needs a helpful message"


def test_names_agree_with_kvshm_api() -> None:
    region, node = CRDS[api.REGION_KIND]["spec"], CRDS[api.NODE_KIND]["spec"]
    assert region["group"] == node["group"] == api.GROUP
    assert region["names"]["plural"] == api.REGION_PLURAL and region["scope"] == "Namespaced"
    assert node["names"]["plural"] == api.NODE_PLURAL and node["scope"] == "Cluster"
    for crd in (region, node):
        assert [v["name"] for v in crd["versions"]] == [api.VERSION]
        assert crd["versions"][0]["subresources"] == {"status": {}}


def test_phases_agree_with_kvshm_api() -> None:
    nodes = dict(schema_nodes(schema_of(api.REGION_KIND)))
    assert nodes["status.phase"]["enum"] == [p.value for p in api.RegionPhase]
    assert nodes["status.nodes[*].phase"]["enum"] == [p.value for p in api.NodeRegionPhase]


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_printer_columns_point_at_fields_of_the_schema(kind: str) -> None:
    paths = {path for path, _ in schema_nodes(schema_of(kind))}
    for column in CRDS[kind]["spec"]["versions"][0]["additionalPrinterColumns"]:
        field = column["jsonPath"].lstrip(".")
        assert field.startswith("metadata.") or field in paths, column


def test_kubectl_get_shows_the_printer_columns(
    envtest_admin: kubernetes.client.ApiClient, envtest_namespace: str
) -> None:
    """The server's Table (what `kubectl get offloadregions` prints) has every column."""
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)
    body = {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.REGION_KIND,
        "metadata": {"name": "r1"},
        "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 4096}},
    }
    custom.create_namespaced_custom_object(
        api.GROUP, api.VERSION, envtest_namespace, api.REGION_PLURAL, body
    )
    path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{envtest_namespace}/{api.REGION_PLURAL}"
    method, url, headers, _, _ = envtest_admin.param_serialize(
        method="GET",
        resource_path=path,
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"],
    )
    response = envtest_admin.call_api(method, url, headers)
    response.read()
    assert response.status == 200, response.data
    answer = json.loads(response.data)
    columns = [c["name"] for c in answer["columnDefinitions"]]
    wanted = CRDS[api.REGION_KIND]["spec"]["versions"][0]["additionalPrinterColumns"]
    assert columns == ["Name", *(c["name"] for c in wanted)]
    assert [row["cells"][0] for row in answer["rows"]] == ["r1"]
