"""Small builders for the operator's plain-function tests: regions, reports, inventories, views."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from kvshm.api import (
    InventoryFile,
    NodeInventory,
    NodeName,
    NodeRegionPhase,
    NodeReport,
    OffloadNode,
    OffloadRegion,
    ReclaimOutcome,
    ReclaimRequest,
    ReclaimResult,
    RetainedFile,
    parse_offload_region,
)
from kvshm.operator.cluster import ClusterSnapshot

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
GIB = 2**30
SILENCE = 60.0
FINALIZER = "kvshm.dev/operator"


def region(
    name: str = "r1",
    *,
    node_names: list[str] | None = None,
    selector: Mapping[str, str] | None = None,
    size_gib: int = 1,
    policy: str = "Delete",
    generation: int = 1,
) -> OffloadRegion:
    placement: dict[str, Any] = {}
    if node_names is not None:
        placement["nodeNames"] = node_names
    if selector is not None:
        placement["nodeSelector"] = dict(selector)
    manifest = {
        "kind": "OffloadRegion",
        "metadata": {"name": name, "namespace": "team", "generation": generation},
        "spec": {
            "layout": {"numBlocks": size_gib * 1024, "cpuPageSize": 2**20, "numWorkers": 1},
            "placement": placement,
            "reclaimPolicy": policy,
        },
    }
    return parse_offload_region(manifest)


def agent(
    name: str,
    *,
    heartbeat_age: float | None = 1.0,
    capacity_gib: int | None = 64,
    files: tuple[InventoryFile, ...] = (),
    requests: tuple[str, ...] = (),
    results: Mapping[str, str] | None = None,
    retained: tuple[str, ...] = (),
) -> OffloadNode:
    return OffloadNode(
        name=NodeName(name),
        status=NodeInventory(
            heartbeat=None if heartbeat_age is None else NOW - timedelta(seconds=heartbeat_age),
            capacity_bytes=None if capacity_gib is None else capacity_gib * GIB,
            free_bytes=None if capacity_gib is None else capacity_gib * GIB,
            files=files,
            reclaims=tuple(
                ReclaimResult(path, ReclaimOutcome.from_status(outcome))
                for path, outcome in (results or {}).items()
            ),
        ),
        reclaims=tuple(ReclaimRequest(path, 1) for path in requests),
        retained=tuple(RetainedFile(path) for path in retained),
    )


def cluster(
    nodes: Mapping[str, Mapping[str, str]] | list[str],
    agents: list[OffloadNode] | None = None,
    *,
    now: datetime = NOW,
    regions: Mapping[str, str] | None = None,
) -> ClusterSnapshot:
    node_map = {name: {} for name in nodes} if isinstance(nodes, list) else dict(nodes)
    agent_list = [agent(name) for name in node_map] if agents is None else agents
    return ClusterSnapshot(
        nodes=node_map,
        agents={item.name: item for item in agent_list},
        now=now,
        silence_seconds=SILENCE,
        regions=dict(regions or {}),
    )


def reports(**phases: str) -> dict[str, NodeReport]:
    """reports(a="Ready", b="Failed: no space") -> status.nodes as the agents wrote it, about
    generation 1 (region()'s default)."""
    result = {}
    for node, text in phases.items():
        phase, _, message = text.partition(": ")
        result[node.replace("_", "-")] = NodeReport(
            NodeRegionPhase(phase), message=message, observed_generation=1
        )
    return result


def file(
    path: str = "team/old/vllm_offload_old.mmap",
    *,
    size: int = 4096,
    claimed_by: str = "",
    held: bool = False,
    orphaned_since: datetime | None = None,
) -> InventoryFile:
    return InventoryFile(
        path=path,
        size_bytes=size,
        claimed_by=claimed_by,
        held=held,
        orphaned_since=orphaned_since,
    )


def region_body(
    *,
    nodes: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
    finalizers: list[str] | None = None,
    deleting: bool = False,
    placement: dict[str, Any] | None = None,
    generation: int = 1,
    policy: str = "Delete",
) -> dict[str, Any]:
    """Region team/r1 as the API server hands it over (a plain object, as kopf's bodies are)."""
    meta: dict[str, Any] = {"name": "r1", "namespace": "team", "uid": "u1"}
    meta["generation"] = generation
    if finalizers is not None:
        meta["finalizers"] = finalizers
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T11:59:00Z"
    written = dict(status or {})
    if nodes:
        written["nodes"] = {
            node: {"phase": phase, "observedGeneration": generation}
            for node, phase in nodes.items()
        }
    return {
        "apiVersion": "kvshm.dev/v1alpha1",
        "kind": "OffloadRegion",
        "metadata": meta,
        "spec": {
            "layout": {"numBlocks": 16, "cpuPageSize": 4096},
            "placement": placement if placement is not None else {"nodeNames": ["a"]},
            "reclaimPolicy": policy,
        },
        "status": written,
    }
