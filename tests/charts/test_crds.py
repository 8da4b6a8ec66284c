"""kvshm's CRDs (charts/kvshm/crds/): shipped, valid, carried by the upgrade hook, and every
OffloadRegion/OffloadNode a user is shown (examples/, docs/) valid against them, strictly."""

from __future__ import annotations

import json
from typing import Any

import yaml

from tests.charts.crd_validation import CrdSchemas
from tests.charts.rendering import find, load_yaml_documents, render
from tests.charts.test_kubernetes_schemas import validate_builtin
from tests.charts.tools import CHART, REPO
from tests.kube.runner import start_kube_api

CRD_FILES = sorted((CHART / "crds").glob("*.yaml"))
EXAMPLE_RESOURCES = sorted([*(REPO / "examples").rglob("*.yaml"), *(REPO / "docs").rglob("*.yaml")])


def test_crds_are_shipped_and_valid() -> None:
    assert {p.name for p in CRD_FILES}, "charts/kvshm/crds/ holds no CRDs"
    crds = [doc for path in CRD_FILES for doc in load_yaml_documents(path)]
    names = {crd["metadata"]["name"] for crd in crds}
    assert names == {"offloadregions.kvshm.dev", "offloadnodes.kvshm.dev"}
    for crd in crds:
        assert validate_builtin(crd) is None


def test_crd_upgrade_hook_carries_every_crd() -> None:
    configmap = find(render(), "ConfigMap", "-crd-upgrade")
    assert configmap["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    shipped = {path.name: load_yaml_documents(path) for path in CRD_FILES}
    carried = {key: list(yaml.safe_load_all(text)) for key, text in configmap["data"].items()}
    assert carried == shipped


def _example_custom_resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in EXAMPLE_RESOURCES:
        for doc in load_yaml_documents(path):
            if str(doc.get("apiVersion", "")).startswith("kvshm.dev/"):
                name = f"{path.relative_to(REPO)}:{doc['kind']}/{doc['metadata']['name']}"
                found.append((name, doc))
    return found


def test_example_custom_resources_match_their_crd() -> None:
    schemas = CrdSchemas(CRD_FILES)
    examples = _example_custom_resources()
    assert any(doc["kind"] == "OffloadRegion" for _, doc in examples)
    errors = {name: schemas.errors(doc) for name, doc in examples if schemas.errors(doc)}
    assert errors == {}


def test_crd_validation_is_strict() -> None:
    schemas = CrdSchemas(CRD_FILES)
    _, region = next((n, d) for n, d in _example_custom_resources() if d["kind"] == "OffloadRegion")
    broken = json.loads(json.dumps(region))
    broken["spec"]["layout"]["numBlock"] = 1
    assert any("numBlock" in error for error in schemas.errors(broken))
    broken = json.loads(json.dumps(region))
    broken["spec"]["layout"]["numBlocks"] = "many"
    assert schemas.errors(broken)


def test_example_custom_resources_are_accepted_by_the_api_emulator() -> None:
    """Created through the API emulator, which applies the CRDs' defaults, schema and CEL rules
    the way an API server does."""
    examples = _example_custom_resources()
    plurals = {"OffloadRegion": "offloadregions", "OffloadNode": "offloadnodes"}
    namespaces = {d["metadata"]["namespace"] for _, d in examples if d["kind"] == "OffloadRegion"}
    kube = start_kube_api()
    try:
        for namespace in namespaces - {"default"}:  # the emulator starts with "default"
            body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            kube.call(lambda s, b=body: s.create(s.resource("", "v1", "namespaces"), None, b))
        for name, doc in examples:
            namespace = doc["metadata"].get("namespace") if doc["kind"] == "OffloadRegion" else None
            created = kube.create("kvshm.dev", "v1alpha1", plurals[doc["kind"]], doc, namespace)
            assert created["metadata"]["name"] == doc["metadata"]["name"], name
    finally:
        kube.stop()
