"""OffloadRegions on the node, through kubectl as a user applies them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.envtest import manifests
from tests.node.chart import wait
from tests.node.node import Node, NodeError

# the serving pods' uid and group (examples/serving), owners of a tenant's region
TENANT_ACCESS = {"uid": 1000, "gid": 1000, "mode": 0o600}


def offload_region(namespace: str, name: str, blocks: int, **spec: Any) -> dict[str, Any]:
    """An OffloadRegion named as its instance id: `blocks` rows of four 64 KiB worker cells."""
    layout = {"numBlocks": blocks, "cpuPageSize": 65536, "numWorkers": 4}
    return manifests.region(name, namespace, instanceId=name, layout=layout, **spec)


def apply_manifest(node: Node, text: str) -> str:
    return node.kubectl("apply", "-f", "-", input=text)


def region(node: Node, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(
            node.kubectl("get", "offloadregion", name, "-n", namespace, "-o", "json")
        )
    except NodeError as exc:
        if "NotFound" in str(exc):
            return None
        raise
    return found


def region_phase(node: Node, namespace: str, name: str) -> str | None:
    found = region(node, namespace, name)
    return None if found is None else (found.get("status") or {}).get("phase")


def node_report(node: Node, namespace: str, name: str) -> dict[str, Any]:
    """The agent's report on the region (status.nodes[<node>])."""
    found = region(node, namespace, name) or {}
    reports: dict[str, Any] = (found.get("status") or {}).get("nodes") or {}
    return next(iter(reports.values()), {})


def regions(node: Node) -> list[tuple[str, str]]:
    listed = json.loads(node.kubectl("get", "offloadregions", "-A", "-o", "json"))["items"]
    return [(r["metadata"]["namespace"], r["metadata"]["name"]) for r in listed]


def remove_regions(node: Node, timeout: float = 120) -> None:
    """Delete every OffloadRegion and wait until the operator released them all (the agent
    drained and removed their files first)."""
    if not _crds_served(node):
        return
    node.kubectl("delete", "offloadregions", "--all", "-A", "--wait=false")
    wait(lambda: not regions(node), timeout, "every OffloadRegion gone", node)


def _crds_served(node: Node) -> bool:
    return "offloadregions.kvshm.dev" in node.kubectl("get", "crds", "-o", "name")


def files_under(root: Path) -> list[str]:
    """Every file and directory below root, relative to it (nothing followed)."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        for name in [*subdirectories, *files]:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)
