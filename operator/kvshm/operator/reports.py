"""What the agents report, as typed values: region status per node, and OffloadNode inventories.

The operator trusts the agents but not blindly: anything missing or malformed in a report is
read the safe way (a file whose `held` is unknown counts as held; an unreadable heartbeat counts
as no heartbeat), so a bad report can delay a decision but never cause an unsafe one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvshm.api import NodeRegionPhase, ReclaimOutcome
from kvshm.region import region_file_name


def parse_timestamp(value: object) -> datetime | None:
    """An RFC 3339 timestamp as Kubernetes writes it ('2026-01-02T03:04:05Z'), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class NodeReport:
    """OffloadRegion.status.nodes.<node>, written by that node's agent only."""

    phase: NodeRegionPhase | None  # None: a phase this operator does not know
    path: str = ""
    populated_bytes: int = 0
    locked: bool = False
    message: str = ""
    observed_generation: int = 0  # the region generation the agent acted on; 0: not said

    def ready_for(self, generation: int) -> bool:
        """Ready, and for this generation of the spec: a report of an older one (or one that
        does not say) is stale, whatever it says."""
        return self.phase is NodeRegionPhase.READY and self.observed_generation >= generation

    @property
    def holds_files(self) -> bool:
        """Whether the node may still have the region's file (anything but Removed)."""
        return self.phase is not NodeRegionPhase.REMOVED


def parse_node_reports(status: Mapping[str, Any] | None) -> dict[str, NodeReport]:
    nodes = (status or {}).get("nodes") or {}
    if not isinstance(nodes, Mapping):
        return {}
    reports = {}
    for node, entry in nodes.items():
        if not isinstance(entry, Mapping):
            continue
        try:
            phase: NodeRegionPhase | None = NodeRegionPhase(str(entry.get("phase")))
        except ValueError:
            phase = None
        reports[str(node)] = NodeReport(
            phase=phase,
            path=_str(entry.get("path")),
            populated_bytes=_int(entry.get("populatedBytes")),
            locked=entry.get("locked") is True,
            message=_str(entry.get("message")),
            observed_generation=_int(entry.get("observedGeneration")),
        )
    return reports


@dataclass(frozen=True)
class InventoryFile:
    """One region-shaped file an agent found under its region root."""

    path: str  # relative to the region root: <namespace>/<name>/vllm_offload_<id>.mmap
    size_bytes: int
    claimed_by: str  # "<namespace>/<name>" of the region the agent matched it to, or ""
    held: bool  # a live process has it open or mapped (unknown counts as held)


@dataclass(frozen=True)
class ReclaimResult:
    """The agent's answer to one reclaim request (an entry of status.reclaims)."""

    path: str
    outcome: ReclaimOutcome
    message: str = ""


@dataclass(frozen=True)
class NodeInventory:
    """An OffloadNode: its agent's heartbeat and findings, and the operator's requests."""

    name: str
    heartbeat: datetime | None
    capacity_bytes: int | None  # None until the agent has measured its root
    free_bytes: int | None
    files: tuple[InventoryFile, ...] = ()
    # spec, written by the operator: entries by path, kept whole to rewrite the lists
    reclaim_requests: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    retained: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    reclaim_results: tuple[ReclaimResult, ...] = ()

    def heartbeat_age(self, now: datetime) -> float | None:
        if self.heartbeat is None:
            return None
        return (now - self.heartbeat).total_seconds()


def _entries_by_path(value: object) -> dict[str, Mapping[str, Any]]:
    """A list-map keyed by path (the CRDs' form), or a plain map path -> entry."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if isinstance(v, Mapping)}
    if isinstance(value, list):
        return {e["path"]: e for e in value if isinstance(e, Mapping) and _str(e.get("path"))}
    return {}


def parse_inventory(body: Mapping[str, Any]) -> NodeInventory:
    metadata = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    files = tuple(
        InventoryFile(
            path=path,
            size_bytes=_int(entry.get("sizeBytes")),
            claimed_by=_str(entry.get("claimedBy")),
            held=entry.get("held") is not False,
        )
        for path, entry in _entries_by_path(status.get("files")).items()
    )
    results = tuple(
        ReclaimResult(
            path, ReclaimOutcome.from_status(entry.get("outcome")), _str(entry.get("message"))
        )
        for path, entry in _entries_by_path(status.get("reclaims")).items()
    )
    capacity = status.get("capacityBytes")
    free = status.get("freeBytes")
    return NodeInventory(
        name=_str(metadata.get("name")),
        heartbeat=parse_timestamp(status.get("heartbeat")),
        capacity_bytes=capacity if isinstance(capacity, int) else None,
        free_bytes=free if isinstance(free, int) else None,
        files=files,
        reclaim_requests=_entries_by_path(spec.get("reclaims")),
        retained=_entries_by_path(spec.get("retained")),
        reclaim_results=results,
    )


def region_file_path(namespace: str, name: str, instance_id: str) -> str:
    """A region's file relative to the region root, as inventories list it."""
    return f"{namespace}/{name}/{region_file_name(instance_id)}"
