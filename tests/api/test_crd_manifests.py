"""The CRD files: valid CRDs, structural, every rule compiles, names agree with kvshm.api."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest

from kvshm import api
from tests.api.admission import rules, schema_nodes
from tests.kube import cel
from tests.kube.runner import load_crds
from tests.kube.tables import json_path

CRDS = {crd["spec"]["names"]["kind"]: crd for crd in load_crds()}


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
def test_every_rule_compiles_and_says_what_to_do(kind: str) -> None:
    found = rules(schema_of(kind))
    assert found
    for path, rule in found:
        cel.compile_rule(rule["rule"])
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
        assert json_path({"metadata": {"name": "x"}}, column["jsonPath"]) in (None, "x")
