"""What the agent reports, as plain values: per-region node reports, the node inventory,
reclaim results and events. Sinks turn them into API patches or console lines."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from kvshm.api import NodeRegionPhase, ReclaimOutcome

__all__ = ["ReclaimOutcome"]  # re-exported: reports carry it


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC, the way Kubernetes writes timestamps."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NodeReport:
    """OffloadRegion.status.nodes.<node>: what this node's agent did with one region."""

    phase: NodeRegionPhase
    path: str = ""
    size_bytes: int = 0
    populated_bytes: int = 0
    locked: bool = False
    populate_seconds: float | None = None
    holders: int | None = None  # processes holding the file's shared flock, when known
    message: str = ""
    files: int = 0  # the region's files (vllm_offload_<id>.mmap, .mmap.1, ...), once known

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "phase": self.phase.value,
            "path": self.path,
            "sizeBytes": self.size_bytes,
            "fileCount": self.files,
            "populatedBytes": self.populated_bytes,
            "locked": self.locked,
            "message": self.message,
            # null, not absent: a merge patch leaves absent keys as an earlier phase set them
            "populateSeconds": (
                None if self.populate_seconds is None else round(self.populate_seconds, 3)
            ),
            "holders": self.holders,
        }
        return status

    def differs_only_in_progress(self, other: NodeReport) -> bool:
        """Whether the two differ in nothing but progress (populated bytes, holder count),
        which is published at most about once a second."""
        return replace(other, populated_bytes=self.populated_bytes, holders=self.holders) == self


class EventReason(StrEnum):
    CREATED = "Created"
    ADOPTED = "Adopted"
    READY = "Ready"
    FAILED = "Failed"
    LOCK_FAILED = "LockFailed"
    DRAINING = "Draining"
    DRAINED = "Drained"
    RECLAIMED = "Reclaimed"
    RECLAIM_REFUSED = "ReclaimRefused"


WARNING_REASONS = frozenset(
    {EventReason.FAILED, EventReason.LOCK_FAILED, EventReason.RECLAIM_REFUSED}
)


@dataclass(frozen=True)
class AgentEvent:
    """Something worth a Kubernetes Event: about a region (region_key) or the node ("")."""

    reason: EventReason
    message: str
    region_key: str = ""
    region_uid: str = ""

    @property
    def warning(self) -> bool:
        return self.reason in WARNING_REASONS


@dataclass(frozen=True)
class InventoryFile:
    """A region's files found under the root (bytes are their size, not what is allocated)."""

    path: str  # relative to the root: <namespace>/<name>/vllm_offload_<id>.mmap (file 0)
    size_bytes: int  # of all its files
    allocated_bytes: int
    claimed_by: str  # "<namespace>/<name>" of the region that names this file, or ""
    held: bool  # a process other than the agent holds it (flock, or /proc when enabled)
    age_seconds: float
    first_seen_unclaimed: datetime | None = None
    files: int = 1  # vllm_offload_<id>.mmap and its .mmap.<i> files

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "path": self.path,
            "sizeBytes": self.size_bytes,
            "fileCount": self.files,
            "claimedBy": self.claimed_by,
            "held": self.held,
            "ageSeconds": int(self.age_seconds),
        }
        if self.first_seen_unclaimed is not None:
            status["firstSeenUnclaimed"] = format_timestamp(self.first_seen_unclaimed)
        return status


@dataclass(frozen=True)
class ReclaimResult:
    path: str
    outcome: ReclaimOutcome
    message: str
    time: datetime

    def to_status(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "outcome": self.outcome.status_value,
            "message": self.message,
            "time": format_timestamp(self.time),
        }


@dataclass(frozen=True)
class NodeInventory:
    """The OffloadNode's status, less heartbeat and version (added by the sink)."""

    root: str
    capacity_bytes: int
    free_bytes: int
    reserve_bytes: int
    files: tuple[InventoryFile, ...] = ()
    problems: tuple[str, ...] = ()  # unsafe or unexpected entries found under the root

    @property
    def orphans(self) -> tuple[InventoryFile, ...]:
        return tuple(f for f in self.files if not f.claimed_by)

    def to_status(self) -> dict[str, Any]:
        """OffloadNode status fields (the sink adds heartbeat, version and conditions)."""
        return {
            "capacityBytes": self.capacity_bytes,
            "freeBytes": self.free_bytes,
            "reserveBytes": self.reserve_bytes,
            "files": [f.to_status() for f in self.files],
        }


@dataclass
class PassResult:
    """Everything one reconcile pass found and did."""

    reports: dict[str, NodeReport] = field(default_factory=dict)  # region key -> its report
    events: list[AgentEvent] = field(default_factory=list)
    inventory: NodeInventory | None = None
    reclaims: dict[str, ReclaimResult] = field(default_factory=dict)  # path -> latest result
    problems: tuple[str, ...] = ()  # the source's (unreadable files, refused specs)
    busy: bool = False  # something is populating or draining: pass again soon
    settled: bool = True  # nothing in progress (local --once may stop)
