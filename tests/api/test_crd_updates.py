"""Rules that depend on the old object (immutability) and OffloadNode's rules, in the real API
server (tests/envtest): its CEL transition rules, list-map keys and enums, as the admin."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
import yaml

from kvshm.api import GROUP, NODE_KIND, NODE_PLURAL, REGION_KIND, REGION_PLURAL, VERSION


class Objects:
    """Creates and merge-patches OffloadRegions (in a fresh namespace) and OffloadNodes."""

    def __init__(self, client: kubernetes.client.ApiClient, namespace: str) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.namespace = namespace

    def create_region(self, name: str = "r1", **spec: Any) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": REGION_KIND,
            "metadata": {"name": name},
            "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 4096}, **spec},
        }
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, self.namespace, REGION_PLURAL, body
        )
        return created

    def patch_region(self, body: dict[str, Any], name: str = "r1") -> dict[str, Any]:
        patched: dict[str, Any] = self.custom.patch_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, self.namespace, REGION_PLURAL, name, body
        )
        return patched

    def create_node(self, reclaims: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": NODE_KIND,
            "metadata": {"name": "n1"},
        }
        if reclaims is not None:
            body["spec"] = {"reclaims": reclaims}
        created: dict[str, Any] = self.custom.create_cluster_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, NODE_PLURAL, body
        )
        return created

    def patch_node_status(self, body: dict[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = self.custom.patch_cluster_custom_object_status(  # type: ignore[assignment]
            GROUP, VERSION, NODE_PLURAL, "n1", body
        )
        return patched


@pytest.fixture
def objects(
    envtest_admin: kubernetes.client.ApiClient, envtest_namespace: str
) -> Iterator[Objects]:
    yield Objects(envtest_admin, envtest_namespace)  # the namespace fixture deletes OffloadNodes


def refusal(call: Callable[..., Any], *args: Any) -> str:
    """The server's message refusing call(*args) (422 Invalid)."""
    with pytest.raises(kubernetes.client.ApiException) as raised:
        call(*args)
    assert raised.value.status == 422, raised.value.body
    message: str = yaml.safe_load(raised.value.body)["message"]
    return message


@pytest.mark.parametrize(
    "change", [{"numBlocks": 32}, {"format": "unpadded"}, {"replicated": True}], ids=str
)
def test_layout_cannot_change(objects: Objects, change: dict[str, object]) -> None:
    objects.create_region()
    message = refusal(objects.patch_region, {"spec": {"layout": change}})
    assert "spec.layout" in message and "immutable" in message


def test_instance_id_cannot_change_nor_come_nor_go(objects: Objects) -> None:
    objects.create_region(instanceId="engine-a")
    assert "immutable" in refusal(objects.patch_region, {"spec": {"instanceId": "engine-b"}})
    assert "added or removed" in refusal(objects.patch_region, {"spec": {"instanceId": None}})
    objects.create_region("r2")
    message = refusal(objects.patch_region, {"spec": {"instanceId": "r2"}}, "r2")
    assert "added or removed" in message


def test_numa_cannot_change_nor_come_nor_go(objects: Objects) -> None:
    """The pages were placed when the region was populated: a changed spec.numa would say
    where they are not."""
    objects.create_region(numa={"nodes": [0]})
    assert "spec.numa is immutable" in refusal(
        objects.patch_region, {"spec": {"numa": {"nodes": [1]}}}
    )
    assert "added or removed" in refusal(objects.patch_region, {"spec": {"numa": None}})
    objects.create_region("r2")
    message = refusal(objects.patch_region, {"spec": {"numa": {"nodes": [0]}}}, "r2")
    assert "spec.numa cannot be added or removed" in message


def test_everything_else_may_change_and_counts_as_a_generation(objects: Objects) -> None:
    objects.create_region()
    changes: list[dict[str, Any]] = [
        {"populate": False},
        {"lock": False},
        {"reclaimPolicy": "Retain"},
        {"access": {"uid": 1000, "mode": 0o660}},
        {"placement": {"nodeNames": ["n1"]}},
    ]
    for generation, change in enumerate(changes, start=2):
        assert objects.patch_region({"spec": change})["metadata"]["generation"] == generation


def reclaim(path: str, **extra: Any) -> dict[str, Any]:
    return {
        "path": path,
        "sizeBytes": 4096,
        "requestedAt": "2024-01-01T00:00:00Z",
        "reason": "orphaned for 600 s, held by no process",
        **extra,
    }


def test_a_reclaim_names_a_file_without_dotdot(objects: Objects) -> None:
    for path in ("../etc/passwd", "default/../../x", "a/.."):
        assert "'..'" in refusal(objects.create_node, [reclaim(path)])
    ok = objects.create_node([reclaim("default/r1/vllm_offload_a.mmap")])
    assert ok["spec"]["reclaims"][0]["path"] == "default/r1/vllm_offload_a.mmap"


def test_reclaims_are_one_per_path_and_complete(objects: Objects) -> None:
    message = refusal(objects.create_node, [reclaim("a"), reclaim("a")])
    assert "Duplicate value" in message
    incomplete = reclaim("a")
    del incomplete["sizeBytes"]
    assert "spec.reclaims[0].sizeBytes: Required value" in refusal(
        objects.create_node, [incomplete]
    )


def test_reclaim_results_use_the_outcome_vocabulary(objects: Objects) -> None:
    objects.create_node()
    result = {
        "path": "a",
        "outcome": "RefusedHeld",
        "message": "pid 42 holds it",
        "time": "2024-01-01T00:00:00Z",
    }
    objects.patch_node_status({"status": {"reclaims": [result]}})
    bad = {"status": {"reclaims": [{**result, "outcome": "refused_held"}]}}
    message = refusal(objects.patch_node_status, bad)
    assert '"Done", "RefusedHeld", "RefusedClaimed", "Failed"' in message


def test_the_root_pages_use_the_huge_pages_vocabulary(objects: Objects) -> None:
    objects.create_node()
    pages = {"sizeBytes": 2097152, "huge": "within_size", "roundsUp": False}
    stored = objects.patch_node_status({"status": {"pages": pages}})
    assert stored["status"]["pages"] == pages
    message = refusal(objects.patch_node_status, {"status": {"pages": {**pages, "huge": "yes"}}})
    assert '"never", "within_size", "always", "advise", "deny", "force", "unknown"' in message
