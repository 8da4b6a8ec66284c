"""Decisions about an OffloadNode as a whole: remove it when its node is gone; the spec that
carries the orphan decisions to its agent (spec.reclaims) and marks retained files."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from typing import Any

from kvshm.operator.cluster import ClusterView
from kvshm.operator.orphans import OrphanDecision
from kvshm.operator.reports import NodeInventory, format_timestamp


def removal_reason(inventory: NodeInventory, cluster: ClusterView) -> str | None:
    """Why this OffloadNode should be deleted, or None to keep it.

    Both must hold: the Node object is gone (drained and deleted, or scaled away), and the
    agent stopped reporting — a Node deleted under a live agent is re-registering, not gone.
    """
    if not cluster.node_gone(inventory.name):
        return None
    heartbeat = format_timestamp(inventory.heartbeat) if inventory.heartbeat else "never"
    return (
        f"node {inventory.name} no longer exists and its agent is silent (last heartbeat "
        f"{heartbeat}): removing its OffloadNode"
    )


def reclaims_after(
    inventory: NodeInventory, decision: OrphanDecision, now: datetime
) -> list[dict[str, Any]] | None:
    """The new spec.reclaims list (a list-map: written whole), or None if it stays as it is.

    New requests are added; requests the agent answered, and ones no longer safe, are removed.
    """
    closed = {item.path for item in decision.withdrawals} | {item.path for item in decision.results}
    if not decision.requests and not closed:
        return None
    entries = [
        dict(entry) for path, entry in inventory.reclaim_requests.items() if path not in closed
    ]
    for request in decision.requests:
        entries.append(
            {
                "path": request.path,
                "sizeBytes": request.size_bytes,
                "requestedAt": format_timestamp(now),
                "reason": f"orphaned since {format_timestamp(request.orphaned_since)}: no "
                "OffloadRegion claims it and no process holds it",
            }
        )
    return sorted(entries, key=lambda entry: str(entry["path"]))


def retained_entry(region_key: str, path: str, now: datetime) -> dict[str, Any]:
    """A spec.retained entry: a file kept on purpose, which orphan reclaim leaves alone."""
    return {"path": path, "region": region_key, "retainedAt": format_timestamp(now)}


def _retained_list(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in spec.get("retained") or () if isinstance(e, Mapping) and "path" in e]


def add_retained(entry: dict[str, Any]) -> Callable[[Mapping[str, Any]], dict[str, Any] | None]:
    """A spec edit that adds one retained file (no change if it is listed already)."""

    def edit(spec: Mapping[str, Any]) -> dict[str, Any] | None:
        entries = _retained_list(spec)
        if any(item["path"] == entry["path"] for item in entries):
            return None
        return {"retained": sorted([*entries, entry], key=lambda item: str(item["path"]))}

    return edit


def forget_retained(paths: Collection[str]) -> Callable[[Mapping[str, Any]], dict[str, Any] | None]:
    """A spec edit that drops retained entries (their file is gone, or a region claims it)."""

    def edit(spec: Mapping[str, Any]) -> dict[str, Any] | None:
        entries = _retained_list(spec)
        kept = [item for item in entries if item["path"] not in paths]
        return None if len(kept) == len(entries) else {"retained": kept}

    return edit
