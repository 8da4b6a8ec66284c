"""Small builders of manifests for tests that talk to the API server (tests/envtest)."""

from __future__ import annotations

from typing import Any

GROUP = "kvshm.dev"
VERSION = "v1alpha1"
REGIONS = "offloadregions"
NODES = "offloadnodes"


def region(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """An OffloadRegion; spec fields override a small valid layout."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadRegion",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 4096}, **spec},
    }


def offload_node(name: str, spec: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    """An OffloadNode (status is dropped on create: write it through /status)."""
    body: dict[str, Any] = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "OffloadNode"}
    body["metadata"] = {"name": name}
    if spec is not None:
        body["spec"] = spec
    if status:
        body["status"] = status
    return body


def node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A v1 Node, as a kubelet would register it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
