"""kvshm's CRDs (charts/kvshm/crds/): shipped, valid, carried by the upgrade hook, and every
OffloadRegion/OffloadNode a user is shown (examples/, docs/) accepted by a real API server
(tests/envtest) with them, strictly (an unknown field refused, as `kubectl apply` does)."""

from __future__ import annotations

import json
from typing import Any

import kubernetes
import pytest
import yaml

from kvshm.api import GROUP, NODE_KIND, NODE_PLURAL, REGION_KIND, REGION_PLURAL, VERSION
from tests.charts.rendering import find, load_yaml_documents, render
from tests.charts.test_kubernetes_schemas import validate_builtin
from tests.charts.tools import CHART, REPO, run, tool
from tests.envtest.chart import ensure_namespace

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


def test_the_crd_upgrade_hook_is_one_hook_deleted_however_it_ends() -> None:
    """One hook document, a List: Helm deletes, by its delete policy, the hook that succeeded or
    failed, so its RBAC goes with its Job; every item carries the same policy for tools that
    unwrap the List."""
    template = "templates/crd-upgrade-job.yaml"
    result = run(tool("helm"), "template", "kvshm", str(CHART), "--show-only", template)
    assert result.returncode == 0, result.stderr
    [hook] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert hook["kind"] == "List"
    policy = {"before-hook-creation", "hook-succeeded", "hook-failed"}
    annotations = hook["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-upgrade"
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == policy
    # Helm creates them in this order, a kind once the one before it exists
    kinds = [item["kind"] for item in hook["items"]]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job"]
    for item in hook["items"]:
        item_annotations = item["metadata"]["annotations"]
        assert item_annotations["helm.sh/hook"] == "pre-upgrade", item["kind"]
        assert set(item_annotations["helm.sh/hook-delete-policy"].split(",")) == policy


def _example_custom_resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in EXAMPLE_RESOURCES:
        for doc in load_yaml_documents(path):
            if str(doc.get("apiVersion", "")).startswith("kvshm.dev/"):
                name = f"{path.relative_to(REPO)}:{doc['kind']}/{doc['metadata']['name']}"
                found.append((name, doc))
    return found


def strict_dry_run(client: kubernetes.client.ApiClient, doc: dict[str, Any]) -> dict[str, Any]:
    """Create `doc` with dryRun=All and fieldValidation=Strict (what `kubectl apply` sends):
    the server's answer, nothing kept. Raises ApiException when refused."""
    custom = kubernetes.client.CustomObjectsApi(client)
    options = {"dry_run": "All", "field_validation": "Strict"}
    created: dict[str, Any]
    if doc["kind"] == REGION_KIND:
        namespace = doc["metadata"].get("namespace", "default")
        ensure_namespace(client, namespace)
        created = custom.create_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, REGION_PLURAL, doc, **options
        )
    else:
        assert doc["kind"] == NODE_KIND, doc["kind"]
        created = custom.create_cluster_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, NODE_PLURAL, doc, **options
        )
    return created


def test_example_custom_resources_are_accepted_strictly_by_the_api_server(
    envtest_admin: kubernetes.client.ApiClient,
) -> None:
    examples = _example_custom_resources()
    assert any(doc["kind"] == REGION_KIND for _, doc in examples)
    for name, doc in examples:
        created = strict_dry_run(envtest_admin, json.loads(json.dumps(doc)))
        assert created["metadata"]["name"] == doc["metadata"]["name"], name


def test_the_servers_validation_is_strict(envtest_admin: kubernetes.client.ApiClient) -> None:
    _, region = next((n, d) for n, d in _example_custom_resources() if d["kind"] == REGION_KIND)
    broken = json.loads(json.dumps(region))
    broken["spec"]["layout"]["numBlock"] = 1
    with pytest.raises(kubernetes.client.ApiException) as refused:
        strict_dry_run(envtest_admin, broken)
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 400 and 'unknown field "spec.layout.numBlock"' in message
    broken = json.loads(json.dumps(region))
    broken["spec"]["layout"]["numBlocks"] = "many"
    with pytest.raises(kubernetes.client.ApiException) as refused:
        strict_dry_run(envtest_admin, broken)
    assert refused.value.status == 422 and "spec.layout.numBlocks" in refused.value.body
