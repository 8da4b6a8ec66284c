"""Decisions about an OffloadNode as a whole: remove it when its node is gone; the spec that
carries the orphan decisions to its agent (spec.reclaims) and marks retained files."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from typing import Any

from kvshm.api import OffloadNode, RetainedFile
from kvshm.api.offload_node import parse_retained
from kvshm.api.reading import MAX_RETAINED, format_timestamp
from kvshm.operator.cluster import ClusterSnapshot
from kvshm.operator.kube import SpecRefused
from kvshm.operator.orphans import OrphanDecision

# spec.retained as JSON, at most: a third of the 1.5 MiB etcd stores per object by default
# (the agent's inventory in status and spec.reclaims share the rest)
RETAINED_MAX_BYTES = 512 * 1024


def removal_reason(node: OffloadNode, cluster: ClusterSnapshot) -> str | None:
    """Why this OffloadNode should be deleted, or None to keep it.

    Both must hold: the Node object is gone (drained and deleted, or scaled away), and the
    agent stopped reporting — a Node deleted under a live agent is re-registering, not gone.
    """
    if not cluster.node_gone(node.name):
        return None
    heartbeat = node.status.heartbeat
    last = format_timestamp(heartbeat) if heartbeat else "never"
    return (
        f"node {node.name} no longer exists and its agent is silent (last heartbeat "
        f"{last}): removing its OffloadNode"
    )


def reclaims_after(
    node: OffloadNode, decision: OrphanDecision, now: datetime
) -> list[dict[str, Any]] | None:
    """The new spec.reclaims list (a list-map: written whole), or None if it stays as it is.

    New requests are added; requests the agent answered, and ones no longer safe, are removed.
    It holds at most MAX_RECLAIMS entries: decide_reclaims requests no more than there is room
    for (the server refuses a longer list, and the whole write with it).
    """
    closed = {item.path for item in decision.withdrawals} | {item.path for item in decision.results}
    if not decision.requests and not closed:
        return None
    kept = [request for request in node.reclaims if request.path not in closed]
    added = [due.request(now) for due in decision.requests]
    return [request.to_spec() for request in sorted(kept + added, key=lambda r: r.path)]


def retained_entry(region_key: str, path: str, now: datetime) -> RetainedFile:
    """A spec.retained entry: a file kept on purpose, which orphan reclaim leaves alone."""
    return RetainedFile(path, region_key, now)


def _retained_spec(entries: list[RetainedFile]) -> dict[str, Any]:
    ordered = sorted(entries, key=lambda entry: entry.path)
    return {"retained": [entry.to_spec() for entry in ordered]}


def add_retained(entry: RetainedFile) -> Callable[[Mapping[str, Any]], dict[str, Any] | None]:
    """A spec edit that adds one retained file (no change if it is listed already).

    SpecRefused when the list is full: the CRD's maxItems, or RETAINED_MAX_BYTES of JSON (the
    whole OffloadNode, its agent's inventory included, must fit the server's object limit)."""

    def edit(spec: Mapping[str, Any]) -> dict[str, Any] | None:
        entries = list(parse_retained(spec))
        if any(item.path == entry.path for item in entries):
            return None
        written = _retained_spec([*entries, entry])
        size = len(json.dumps(written["retained"]))
        if len(entries) >= MAX_RETAINED or size > RETAINED_MAX_BYTES:
            raise SpecRefused(
                f"spec.retained is full ({len(entries)} entries of at most {MAX_RETAINED}, "
                f"{size} bytes with this one, of at most {RETAINED_MAX_BYTES}): {entry.path} "
                "is not marked retained, and orphan reclaim may remove it after the grace "
                "period. Delete entries of files no longer wanted (kubectl edit onode)"
            )
        return written

    return edit


def forget_retained(paths: Collection[str]) -> Callable[[Mapping[str, Any]], dict[str, Any] | None]:
    """A spec edit that drops retained entries (their file is gone, or a region claims it)."""

    def edit(spec: Mapping[str, Any]) -> dict[str, Any] | None:
        entries = list(parse_retained(spec))
        kept = [item for item in entries if item.path not in paths]
        return None if len(kept) == len(entries) else _retained_spec(kept)

    return edit
