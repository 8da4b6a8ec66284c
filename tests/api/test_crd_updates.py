"""Rules that depend on the old object (immutability) and OffloadNode's rules, in the emulator."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.kube.errors import ApiError
from tests.kube.manifests import offload_node, region
from tests.kube.resources import CRD_TYPE
from tests.kube.runner import load_crds
from tests.kube.store import Store

MERGE = "application/merge-patch+json"


@pytest.fixture
def store() -> Store:
    store = Store()
    for crd in load_crds():
        store.create(CRD_TYPE, None, copy.deepcopy(crd))
    return store


def patch_region(store: Store, body: dict[str, Any], name: str = "r1") -> dict[str, Any]:
    regions = store.resource("kvshm.dev", "v1alpha1", "offloadregions")
    return store.patch(regions, "default", name, MERGE, body, None)


def create_region(store: Store, **spec: Any) -> dict[str, Any]:
    regions = store.resource("kvshm.dev", "v1alpha1", "offloadregions")
    return store.create(regions, "default", region("r1", **spec))


def refusal(call: Any, *args: Any) -> str:
    with pytest.raises(ApiError) as raised:
        call(*args)
    assert raised.value.code == 422, raised.value
    return raised.value.message


@pytest.mark.parametrize(
    "change", [{"numBlocks": 32}, {"format": "unpadded"}, {"replicated": True}], ids=str
)
def test_layout_cannot_change(store: Store, change: dict[str, object]) -> None:
    create_region(store)
    message = refusal(patch_region, store, {"spec": {"layout": change}})
    assert "spec.layout" in message and "immutable" in message


def test_instance_id_cannot_change_nor_come_nor_go(store: Store) -> None:
    create_region(store, instanceId="engine-a")
    assert "immutable" in refusal(patch_region, store, {"spec": {"instanceId": "engine-b"}})
    assert "added or removed" in refusal(patch_region, store, {"spec": {"instanceId": None}})
    store.create(store.resource("kvshm.dev", "v1alpha1", "offloadregions"), "default", region("r2"))
    message = refusal(patch_region, store, {"spec": {"instanceId": "r2"}}, "r2")
    assert "added or removed" in message


def test_everything_else_may_change_and_counts_as_a_generation(store: Store) -> None:
    create_region(store)
    changes: list[dict[str, Any]] = [
        {"populate": False},
        {"lock": False},
        {"reclaimPolicy": "Retain"},
        {"access": {"uid": 1000, "mode": 0o660}},
        {"placement": {"nodeNames": ["n1"]}},
    ]
    for generation, change in enumerate(changes, start=2):
        assert patch_region(store, {"spec": change})["metadata"]["generation"] == generation


def node_with_reclaims(store: Store, reclaims: list[dict[str, Any]]) -> dict[str, Any]:
    nodes = store.resource("kvshm.dev", "v1alpha1", "offloadnodes")
    body = offload_node("n1")
    body["spec"] = {"reclaims": reclaims}
    return store.create(nodes, None, body)


def reclaim(path: str, **extra: Any) -> dict[str, Any]:
    return {
        "path": path,
        "sizeBytes": 4096,
        "requestedAt": "2024-01-01T00:00:00Z",
        "reason": "orphaned for 600 s, held by no process",
        **extra,
    }


def test_a_reclaim_names_a_file_without_dotdot(store: Store) -> None:
    ok = node_with_reclaims(store, [reclaim("default/r1/vllm_offload_a.mmap", instanceId="a")])
    assert ok["spec"]["reclaims"][0]["instanceId"] == "a"
    for path in ("../etc/passwd", "default/../../x", "a/.."):
        assert "'..'" in refusal(node_with_reclaims, store, [reclaim(path)])


def test_reclaims_are_one_per_path_and_complete(store: Store) -> None:
    message = refusal(node_with_reclaims, store, [reclaim("a"), reclaim("a")])
    assert "Duplicate value" in message
    incomplete = reclaim("a")
    del incomplete["sizeBytes"]
    assert "spec.reclaims[0].sizeBytes: Required value" in refusal(
        node_with_reclaims, store, [incomplete]
    )


def test_reclaim_results_use_the_outcome_vocabulary(store: Store) -> None:
    nodes = store.resource("kvshm.dev", "v1alpha1", "offloadnodes")
    store.create(nodes, None, offload_node("n1"))
    result = {
        "path": "a",
        "outcome": "RefusedHeld",
        "message": "pid 42 holds it",
        "time": "2024-01-01T00:00:00Z",
    }
    store.patch(nodes, None, "n1", MERGE, {"status": {"reclaims": [result]}}, "status")
    bad = {"status": {"reclaims": [{**result, "outcome": "refused_held"}]}}
    message = refusal(store.patch, nodes, None, "n1", MERGE, bad, "status")
    assert '"Done", "RefusedHeld", "RefusedClaimed", "Failed"' in message
