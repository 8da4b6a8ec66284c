"""Object semantics of the emulator, checked over HTTP with the kubernetes client."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import kmock
import kubernetes
import pytest

from tests.kube.manifests import GROUP, NODES, REGIONS, VERSION, node, offload_node, region
from tests.kube.runner import KubeApi, start_kube_api

ApiException = kubernetes.client.ApiException
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
def api(kube_api: KubeApi) -> Iterator[kubernetes.client.CustomObjectsApi]:
    with kube_api.api_client() as client:
        yield kubernetes.client.CustomObjectsApi(client)


@pytest.fixture
def core(kube_api: KubeApi) -> Iterator[kubernetes.client.CoreV1Api]:
    with kube_api.api_client() as client:
        yield kubernetes.client.CoreV1Api(client)


def make(api: kubernetes.client.CustomObjectsApi, name: str, **spec: Any) -> dict[str, Any]:
    created: dict[str, Any] = api.create_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, region(name, **spec)
    )
    return created


def get(api: kubernetes.client.CustomObjectsApi, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = api.get_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, name)
    return obj


def patch(
    api: kubernetes.client.CustomObjectsApi, name: str, body: Any, **kw: Any
) -> dict[str, Any]:
    obj: dict[str, Any] = api.patch_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, name, body, **kw
    )
    return obj


def patch_status(api: kubernetes.client.CustomObjectsApi, name: str, body: Any) -> dict[str, Any]:
    obj: dict[str, Any] = api.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", REGIONS, name, body
    )
    return obj


def error_of(raised: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(raised.value.body)
    return body


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def test_create_applies_defaults_and_server_fields(api: kubernetes.client.CustomObjectsApi) -> None:
    created = make(api, "r1")
    meta = created["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert created["spec"]["access"] == {"uid": 0, "gid": 0, "mode": 0o600}
    assert created["spec"]["layout"]["numWorkers"] == 1
    assert get(api, "r1") == created


def test_an_invalid_region_is_refused_with_422_naming_the_field(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    with pytest.raises(ApiException) as raised:
        make(api, "r1", access={"mode": 0o644})
    assert raised.value.status == 422
    status = error_of(raised)
    assert status["reason"] == "Invalid"
    assert "spec.access.mode" in status["message"] and "0600" in status["message"]
    with pytest.raises(ApiException) as missing:
        get(api, "r1")
    assert missing.value.status == 404


def test_an_invalid_update_is_refused_and_changes_nothing(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    created = make(api, "r1")
    with pytest.raises(ApiException) as raised:
        patch(api, "r1", {"spec": {"reclaimPolicy": "Keep"}})
    assert raised.value.status == 422
    assert 'supported values: "Delete", "Retain"' in error_of(raised)["message"]
    assert get(api, "r1") == created


def test_a_failed_json_patch_test_is_422_and_changes_nothing(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    created = make(api, "r1")
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["kvshm.dev/operator"]},
    ]
    with pytest.raises(ApiException) as raised:
        patch(api, "r1", stale, _content_type=JSON_PATCH)
    assert raised.value.status == 422
    assert get(api, "r1") == created
    fresh = [{**stale[0], "value": created["metadata"]["resourceVersion"]}, stale[1]]
    patched = patch(api, "r1", fresh, _content_type=JSON_PATCH)
    assert patched["metadata"]["finalizers"] == ["kvshm.dev/operator"]


def test_a_no_op_patch_keeps_the_resource_version(api: kubernetes.client.CustomObjectsApi) -> None:
    created = make(api, "r1", populate=True)
    assert rv(patch(api, "r1", {"spec": {"populate": True}})) == rv(created)
    assert rv(patch(api, "r1", {"spec": {"populate": False}})) > rv(created)


def test_generation_counts_spec_changes_only(api: kubernetes.client.CustomObjectsApi) -> None:
    make(api, "r1")
    assert patch(api, "r1", {"metadata": {"labels": {"a": "b"}}})["metadata"]["generation"] == 1
    assert patch_status(api, "r1", {"status": {"phase": "Ready"}})["metadata"]["generation"] == 1
    assert patch(api, "r1", {"spec": {"lock": False}})["metadata"]["generation"] == 2


def test_the_status_subresource_owns_status_and_only_status(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    created = api.create_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, {**region("r1"), "status": {"phase": "Ready"}}
    )
    assert "status" not in created  # status is written through /status only
    patched = patch(api, "r1", {"spec": {"lock": False}, "status": {"phase": "Ready"}})
    assert "status" not in patched and patched["spec"]["lock"] is False
    patched = patch_status(api, "r1", {"spec": {"lock": True}, "status": {"phase": "Pending"}})
    assert patched["status"] == {"phase": "Pending"} and patched["spec"]["lock"] is False
    with pytest.raises(ApiException) as raised:
        patch_status(api, "r1", {"status": {"phase": "Sleeping"}})
    assert raised.value.status == 422


def test_update_needs_the_current_resource_version(api: kubernetes.client.CustomObjectsApi) -> None:
    created = make(api, "r1")
    patch(api, "r1", {"spec": {"lock": False}})
    with pytest.raises(ApiException) as stale:
        api.replace_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1", created)
    assert stale.value.status == 409
    del created["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as missing:
        api.replace_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1", created)
    assert missing.value.status == 422
    current = get(api, "r1")
    current["spec"]["populate"] = False
    replaced = api.replace_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, "r1", current
    )
    assert replaced["spec"]["populate"] is False and rv(replaced) > rv(current)


def test_finalizers_hold_a_deleted_object_until_they_are_removed(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    make(api, "r1")
    patch(api, "r1", {"metadata": {"finalizers": ["kvshm.dev/operator"]}})
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1")
    held = get(api, "r1")
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["generation"] == 2
    with pytest.raises(ApiException) as raised:
        patch(api, "r1", {"metadata": {"finalizers": ["kvshm.dev/operator", "other"]}})
    assert raised.value.status == 422 and "no new finalizers" in error_of(raised)["message"]
    # status writes and deletes again are fine while it waits
    patch_status(api, "r1", {"status": {"phase": "Terminating"}})
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1")
    patch(api, "r1", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as gone:
        get(api, "r1")
    assert gone.value.status == 404


def test_delete_without_finalizers_removes_at_once(api: kubernetes.client.CustomObjectsApi) -> None:
    make(api, "r1")
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1")
    with pytest.raises(ApiException) as gone:
        get(api, "r1")
    assert gone.value.status == 404
    make(api, "r1")  # the name is free again


def test_namespaces_must_exist_and_take_their_objects_with_them(
    api: kubernetes.client.CustomObjectsApi, core: kubernetes.client.CoreV1Api
) -> None:
    body = region("r1", namespace="team-a")
    with pytest.raises(ApiException) as missing:
        api.create_namespaced_custom_object(GROUP, VERSION, "team-a", REGIONS, body)
    assert missing.value.status == 404
    core.create_namespace({"metadata": {"name": "team-a"}})
    api.create_namespaced_custom_object(GROUP, VERSION, "team-a", REGIONS, body)
    api.patch_namespaced_custom_object(
        GROUP, VERSION, "team-a", REGIONS, "r1", {"metadata": {"finalizers": ["x"]}}
    )
    core.delete_namespace("team-a")
    assert core.read_namespace("team-a").status.phase == "Terminating"
    with pytest.raises(ApiException) as forbidden:
        api.create_namespaced_custom_object(
            GROUP, VERSION, "team-a", REGIONS, region("r2", "team-a")
        )
    assert forbidden.value.status == 403
    api.patch_namespaced_custom_object(
        GROUP, VERSION, "team-a", REGIONS, "r1", {"metadata": {"finalizers": None}}
    )
    assert "team-a" not in [ns.metadata.name for ns in core.list_namespace().items]


def test_custom_resources_refuse_strategic_merge_patches(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    make(api, "r1")
    with pytest.raises(ApiException) as raised:
        patch(
            api,
            "r1",
            {"spec": {"lock": False}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert raised.value.status == 415


def test_nodes_take_strategic_merge_patches(core: kubernetes.client.CoreV1Api) -> None:
    core.create_node(node("n1", {"a": "1"}))
    core.patch_node("n1", {"metadata": {"labels": {"b": "2"}}})
    condition = {"type": "MemoryPressure", "status": "False"}
    patched = core.patch_node_status("n1", {"status": {"conditions": [condition]}})
    assert patched.metadata.labels == {"a": "1", "b": "2"}
    assert sorted(c.type for c in patched.status.conditions) == ["MemoryPressure", "Ready"]


def test_cluster_scoped_offload_nodes(api: kubernetes.client.CustomObjectsApi) -> None:
    created = api.create_cluster_custom_object(GROUP, VERSION, NODES, offload_node("n1"))
    assert created["spec"] == {} and "namespace" not in created["metadata"]
    status = {
        "status": {
            "capacityBytes": 1 << 30,
            "freeBytes": 1 << 29,
            "heartbeat": "2024-01-01T00:00:00Z",
        }
    }
    patched = api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, "n1", status)
    assert patched["status"]["freeBytes"] == 1 << 29
    with pytest.raises(ApiException) as raised:
        api.patch_cluster_custom_object_status(
            GROUP, VERSION, NODES, "n1", {"status": {"heartbeat": "yesterday"}}
        )
    assert raised.value.status == 422 and "date-time" in error_of(raised)["message"]


def test_discovery_lists_what_kopf_and_kubectl_look_for(kube_api: KubeApi) -> None:
    def fetch(path: str) -> dict[str, Any]:
        with urllib.request.urlopen(kube_api.url + path, timeout=5) as response:
            body: dict[str, Any] = json.load(response)
        return body

    core = {r["name"] for r in fetch("/api/v1")["resources"]}
    assert {"namespaces", "nodes", "events", "nodes/status", "namespaces/status"} <= core
    groups = {g["name"] for g in fetch("/apis")["groups"]}
    assert {"kvshm.dev", "events.k8s.io", "coordination.k8s.io", "apiextensions.k8s.io"} <= groups
    kvshm = {r["name"]: r for r in fetch("/apis/kvshm.dev/v1alpha1")["resources"]}
    assert set(kvshm) == {
        "offloadregions",
        "offloadregions/status",
        "offloadnodes",
        "offloadnodes/status",
    }
    assert (
        kvshm["offloadregions"]["shortNames"] == ["oreg"] and kvshm["offloadregions"]["namespaced"]
    )
    assert (
        kvshm["offloadnodes"]["shortNames"] == ["onode"] and not kvshm["offloadnodes"]["namespaced"]
    )
    assert kvshm["offloadregions"]["categories"] == ["kvshm"]
    assert fetch("/apis/kvshm.dev")["preferredVersion"]["version"] == "v1alpha1"


def test_kubectl_tables_show_the_printer_columns(
    kube_api: KubeApi, api: kubernetes.client.CustomObjectsApi
) -> None:
    make(api, "r1")
    patch_status(
        api,
        "r1",
        {"status": {"phase": "Ready", "sizeBytes": 65536, "nodesReady": 1, "nodesWanted": 2}},
    )
    request = urllib.request.Request(
        f"{kube_api.url}/apis/{GROUP}/{VERSION}/namespaces/default/{REGIONS}",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        table = json.load(response)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Phase", "Size", "Ready", "Wanted", "Instance", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[:5] == ["r1", "Ready", 65536, 1, 2] and cells[6].endswith("s")


def test_lists_page_with_limit_and_continue(api: kubernetes.client.CustomObjectsApi) -> None:
    for i in range(5):
        make(api, f"r{i}")
    first = api.list_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, limit=2)
    assert [o["metadata"]["name"] for o in first["items"]] == ["r0", "r1"]
    rest = api.list_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, limit=10, _continue=first["metadata"]["continue"]
    )
    assert [o["metadata"]["name"] for o in rest["items"]] == ["r2", "r3", "r4"]
    assert "continue" not in rest["metadata"]


def test_dry_run_stores_nothing(api: kubernetes.client.CustomObjectsApi) -> None:
    api.create_namespaced_custom_object(
        GROUP, VERSION, "default", REGIONS, region("r1"), dry_run="All"
    )
    assert api.list_namespaced_custom_object(GROUP, VERSION, "default", REGIONS)["items"] == []


def test_events_in_both_apis(kube_api: KubeApi, core: kubernetes.client.CoreV1Api) -> None:
    event = {
        "metadata": {"generateName": "r1-"},
        "involvedObject": {"kind": "OffloadRegion", "name": "r1", "namespace": "default"},
        "reason": "Created",
        "message": "region file created",
        "type": "Normal",
    }
    created = core.create_namespaced_event("default", event)
    assert created.metadata.name.startswith("r1-")
    with kube_api.api_client() as client:
        events_v1 = kubernetes.client.EventsV1Api(client)
        new_event = {
            "metadata": {"name": "e1"},
            "eventTime": "2024-01-01T00:00:00.000000Z",
            "reportingController": "kvshm.dev/agent",
            "reportingInstance": "n1",
            "action": "Populate",
            "reason": "Populated",
            "type": "Normal",
        }
        events_v1.create_namespaced_event("default", new_event)
        assert [e.metadata.name for e in events_v1.list_namespaced_event("default").items] == ["e1"]


def test_kmock_reactions_come_first_for_fault_injection(
    kube_api: KubeApi, api: kubernetes.client.CustomObjectsApi
) -> None:
    kube_api.handler["get", kmock.resource(GROUP, VERSION, REGIONS)] << 503
    with pytest.raises(ApiException) as raised:
        api.list_namespaced_custom_object(GROUP, VERSION, "default", REGIONS)
    assert raised.value.status == 503
    make(api, "r1")  # other requests still reach the emulated server
    assert kube_api.handler.failures == []


def test_unknown_fields_are_pruned_reported_and_refused_when_strict(
    kube_api: KubeApi, api: kubernetes.client.CustomObjectsApi
) -> None:
    body = region("r1", colour="blue")
    created, _, headers = api.create_namespaced_custom_object_with_http_info(
        GROUP, VERSION, "default", REGIONS, body
    )
    assert "colour" not in created["spec"]
    assert 'unknown field \\"spec.colour\\"' in headers["Warning"]
    patch_status(
        api, "r1", {"status": {"phase": "Ready", "nodes": {"n1": {"phase": "Ready", "speed": 1}}}}
    )
    assert kube_api.unknown_fields == [
        "OffloadRegion default/r1: spec.colour",
        "OffloadRegion default/r1: status.nodes[n1].speed",
    ]
    with pytest.raises(ApiException) as raised:
        api.create_namespaced_custom_object(
            GROUP,
            VERSION,
            "default",
            REGIONS,
            region("r2", colour="red"),
            field_validation="Strict",
        )
    assert raised.value.status == 400 and "spec.colour" in error_of(raised)["message"]


def test_delete_preconditions(api: kubernetes.client.CustomObjectsApi) -> None:
    created = make(api, "r1")
    stale = kubernetes.client.V1DeleteOptions(preconditions={"resourceVersion": "1"})
    with pytest.raises(ApiException) as raised:
        api.delete_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1", body=stale)
    assert raised.value.status == 409
    current = kubernetes.client.V1DeleteOptions(preconditions={"uid": created["metadata"]["uid"]})
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, "r1", body=current)


def test_start_kube_api_runs_outside_pytest() -> None:
    with (
        start_kube_api() as server,
        urllib.request.urlopen(server.url + "/version", timeout=5) as response,
    ):
        assert json.load(response)["major"] == "1"


def test_every_problem_of_a_manifest_is_reported_at_once(
    api: kubernetes.client.CustomObjectsApi,
) -> None:
    body = region("r1", access={"mode": 0o644})
    body["spec"]["layout"]["numBlocks"] = 0
    with pytest.raises(ApiException) as raised:
        api.create_namespaced_custom_object(GROUP, VERSION, "default", REGIONS, body)
    fields = [cause["field"] for cause in error_of(raised)["details"]["causes"]]
    assert fields == ["spec.layout.numBlocks", "spec.access.mode"]
