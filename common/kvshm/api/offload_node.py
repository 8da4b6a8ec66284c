"""The OffloadNode records of the status contract (kvshm.api.status has the table): the
node's inventory the agent writes, the reclaims and retained files the operator asks for."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from kvshm.api.address import NodeName
from kvshm.api.messages import MAX_STATUS_MESSAGE, bounded
from kvshm.api.offload_region import ReclaimOutcome
from kvshm.api.reading import (
    MAX_AGENT_VERSION,
    MAX_INVENTORY_FILES,
    MAX_PATH,
    MAX_REASON,
    MAX_RECLAIMS,
    MAX_REGION_KEY,
    MAX_RETAINED,
    format_timestamp,
    keep_field,
    maybe_whole_seconds,
    parse_timestamp,
    read_count,
    read_entries,
    read_nonnegative,
    read_str,
)
from kvshm.region import RegionLayout

# --- OffloadNode status ----------------------------------------------------------------------


@dataclass(frozen=True)
class InventoryFile:
    """One region found under a node's region root (all its files as one entry)."""

    path: str  # relative to the root: <namespace>/<name>/vllm_offload_<id>.mmap (file 0)
    size_bytes: int  # of all its files
    claimed_by: str  # "<namespace>/<name>" of the region that names this file, or ""
    held: bool  # a process other than the agent holds it (unknown counts as held)
    age_seconds: int = 0  # since its newest file was last written
    # since when the agent has seen it an orphan, unclaimed and unheld (kept over agent
    # restarts, rounded up to a second); the operator's orphan grace period counts from it, so
    # it survives operator restarts too. None while claimed or held.
    orphaned_since: datetime | None = None
    files: int = 1  # vllm_offload_<id>.mmap and its .mmap.<i> files

    def __post_init__(self) -> None:
        keep_field(self, "age_seconds", int(self.age_seconds))
        keep_field(self, "orphaned_since", maybe_whole_seconds(self.orphaned_since))

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "path": self.path,
            "sizeBytes": self.size_bytes,
            "fileCount": self.files,
            "claimedBy": self.claimed_by,
            "held": self.held,
            "ageSeconds": self.age_seconds,
        }
        if self.orphaned_since is not None:
            status["orphanedSince"] = format_timestamp(self.orphaned_since)
        return status

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> InventoryFile:
        files = read_nonnegative(entry.get("fileCount"))
        return cls(
            path=read_str(entry.get("path"), MAX_PATH),
            size_bytes=read_count(entry.get("sizeBytes")),
            claimed_by=read_str(entry.get("claimedBy"), MAX_REGION_KEY),
            held=entry.get("held") is not False,
            age_seconds=read_count(entry.get("ageSeconds")),
            orphaned_since=parse_timestamp(entry.get("orphanedSince")),
            files=1 if files is None else files,
        )


@dataclass(frozen=True)
class ReclaimResult:
    """The agent's answer to one reclaim request (OffloadNode status.reclaims[])."""

    path: str
    outcome: ReclaimOutcome
    message: str = ""
    time: datetime | None = None

    def __post_init__(self) -> None:
        keep_field(self, "message", bounded(self.message, MAX_STATUS_MESSAGE))
        keep_field(self, "time", maybe_whole_seconds(self.time))

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "path": self.path,
            "outcome": self.outcome.status_value,
            "message": self.message,
        }
        if self.time is not None:
            status["time"] = format_timestamp(self.time)
        return status

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> ReclaimResult:
        return cls(
            path=read_str(entry.get("path"), MAX_PATH),
            outcome=ReclaimOutcome.from_status(entry.get("outcome")),
            message=read_str(entry.get("message"), MAX_STATUS_MESSAGE),
            time=parse_timestamp(entry.get("time")),
        )


class HugePages(StrEnum):
    """How the region root's tmpfs gives files huge pages: its huge= mount option, or the
    host-wide override of /sys/kernel/mm/transparent_hugepage/shmem_enabled (deny, force)."""

    NEVER = "never"
    WITHIN_SIZE = "within_size"
    ALWAYS = "always"
    ADVISE = "advise"
    DENY = "deny"
    FORCE = "force"
    UNKNOWN = "unknown"  # the root's mount is not in the agent's mount table

    @classmethod
    def read(cls, value: object) -> HugePages:
        return next((member for member in cls if member.value == value), cls.UNKNOWN)


@dataclass(frozen=True)
class RootPages:
    """The pages a region file gets on a node's region root, as its agent found them by making
    one (OffloadNode status.pages)."""

    size_bytes: int  # a huge page (2 MiB) where region files get them, else the base page
    huge: HugePages = HugePages.UNKNOWN
    rounds_up: bool = False  # a file's last, partial huge page takes a whole one

    def allocation_bytes(self, layout: RegionLayout) -> int:
        """What the root's filesystem holds for the region's files once all are populated."""
        if self.rounds_up:
            return layout.allocation_bytes(self.size_bytes)
        return layout.size_bytes

    def to_status(self) -> dict[str, Any]:
        return {"sizeBytes": self.size_bytes, "huge": self.huge.value, "roundsUp": self.rounds_up}

    @classmethod
    def from_status(cls, entry: object) -> RootPages | None:
        if not isinstance(entry, Mapping):
            return None
        size = read_nonnegative(entry.get("sizeBytes"))
        if not size:
            return None
        # an unreadable roundsUp reads as rounding: capacity is then never overestimated
        return cls(size, HugePages.read(entry.get("huge")), entry.get("roundsUp") is not False)


@dataclass(frozen=True)
class NodeInventory:
    """OffloadNode status, written by its agent only (less conditions: the agent's RootSafe and
    InventoryComplete conditions are for people; no decision reads them)."""

    capacity_bytes: int | None = None  # None until the agent has measured its root
    free_bytes: int | None = None
    reserve_bytes: int = 0
    files: tuple[InventoryFile, ...] = ()
    reclaims: tuple[ReclaimResult, ...] = ()
    heartbeat: datetime | None = None
    agent_version: str = ""
    pages: RootPages | None = None  # None until the agent has probed its root

    def __post_init__(self) -> None:
        keep_field(self, "heartbeat", maybe_whole_seconds(self.heartbeat))

    def allocation_bytes(self, layout: RegionLayout) -> int:
        """What the node's root holds for a region of this layout (its size where unknown)."""
        return layout.size_bytes if self.pages is None else self.pages.allocation_bytes(layout)

    @property
    def orphans(self) -> tuple[InventoryFile, ...]:
        """Files no region claims (held or not)."""
        return tuple(f for f in self.files if not f.claimed_by)

    def heartbeat_age(self, now: datetime) -> float | None:
        if self.heartbeat is None:
            return None
        return (now - self.heartbeat).total_seconds()

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "capacityBytes": self.capacity_bytes,
            "freeBytes": self.free_bytes,
            "reserveBytes": self.reserve_bytes,
            "files": [f.to_status() for f in self.files],
            "reclaims": [r.to_status() for r in self.reclaims],
        }
        if self.heartbeat is not None:
            status["heartbeat"] = format_timestamp(self.heartbeat)
        if self.agent_version:
            status["agentVersion"] = self.agent_version
        if self.pages is not None:
            status["pages"] = self.pages.to_status()
        return status

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> NodeInventory:
        return cls(
            capacity_bytes=read_nonnegative(status.get("capacityBytes")),
            free_bytes=read_nonnegative(status.get("freeBytes")),
            reserve_bytes=read_count(status.get("reserveBytes")),
            files=tuple(
                InventoryFile.from_status(e)
                for e in read_entries(status.get("files"), MAX_INVENTORY_FILES)
            ),
            reclaims=tuple(
                ReclaimResult.from_status(e)
                for e in read_entries(status.get("reclaims"), MAX_RECLAIMS)
            ),
            heartbeat=parse_timestamp(status.get("heartbeat")),
            agent_version=read_str(status.get("agentVersion"), MAX_AGENT_VERSION),
            pages=RootPages.from_status(status.get("pages")),
        )


# --- OffloadNode spec ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReclaimRequest:
    """A file the operator decided to remove (OffloadNode spec.reclaims[]); the agent checks
    every condition again before it removes anything."""

    path: str  # as the agent reported it in status.files[].path
    size_bytes: int | None = None  # the size decided on; the agent refuses another size
    requested_at: datetime | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        keep_field(self, "reason", bounded(self.reason, MAX_REASON))
        keep_field(self, "requested_at", maybe_whole_seconds(self.requested_at))

    @property
    def token(self) -> str:
        """The request's whole content: one written again (a new requestedAt) runs again."""
        return json.dumps(self.to_spec(), sort_keys=True)

    def to_spec(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path}
        if self.size_bytes is not None:
            entry["sizeBytes"] = self.size_bytes
        if self.requested_at is not None:
            entry["requestedAt"] = format_timestamp(self.requested_at)
        if self.reason:
            entry["reason"] = self.reason
        return entry

    @classmethod
    def from_spec(cls, entry: Mapping[str, Any]) -> ReclaimRequest:
        return cls(
            path=read_str(entry.get("path"), MAX_PATH),
            size_bytes=read_nonnegative(entry.get("sizeBytes")),
            requested_at=parse_timestamp(entry.get("requestedAt")),
            reason=read_str(entry.get("reason"), MAX_REASON),
        )


@dataclass(frozen=True)
class RetainedFile:
    """A file kept on purpose (OffloadNode spec.retained[]): its region was deleted with
    reclaimPolicy Retain, and orphan reclaim leaves it alone until the entry goes."""

    path: str
    region: str = ""  # <namespace>/<name> of the deleted region
    retained_at: datetime | None = None

    def __post_init__(self) -> None:
        keep_field(self, "retained_at", maybe_whole_seconds(self.retained_at))

    def to_spec(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path}
        if self.region:
            entry["region"] = self.region
        if self.retained_at is not None:
            entry["retainedAt"] = format_timestamp(self.retained_at)
        return entry

    @classmethod
    def from_spec(cls, entry: Mapping[str, Any]) -> RetainedFile:
        return cls(
            path=read_str(entry.get("path"), MAX_PATH),
            region=read_str(entry.get("region"), MAX_REGION_KEY),
            retained_at=parse_timestamp(entry.get("retainedAt")),
        )


def parse_reclaim_requests(spec: Mapping[str, Any] | None) -> tuple[ReclaimRequest, ...]:
    entries = read_entries((spec or {}).get("reclaims"), MAX_RECLAIMS)
    return tuple(ReclaimRequest.from_spec(entry) for entry in entries)


def parse_retained(spec: Mapping[str, Any] | None) -> tuple[RetainedFile, ...]:
    entries = read_entries((spec or {}).get("retained"), MAX_RETAINED)
    return tuple(RetainedFile.from_spec(entry) for entry in entries)


@dataclass(frozen=True)
class OffloadNode:
    """One node's OffloadNode: the operator's requests (spec) and its agent's inventory."""

    name: NodeName
    status: NodeInventory = field(default_factory=NodeInventory)
    reclaims: tuple[ReclaimRequest, ...] = ()  # spec.reclaims
    retained: tuple[RetainedFile, ...] = ()  # spec.retained

    def reclaim_request(self, path: str) -> ReclaimRequest | None:
        return next((request for request in self.reclaims if request.path == path), None)

    def retained_file(self, path: str) -> RetainedFile | None:
        return next((entry for entry in self.retained if entry.path == path), None)


def parse_offload_node(body: Mapping[str, Any]) -> OffloadNode | None:
    """An OffloadNode from its API object, or None when its name is no node name."""
    metadata = body.get("metadata") or {}
    name = NodeName.parse(metadata.get("name") if isinstance(metadata, Mapping) else None)
    if name is None:
        return None
    spec = body.get("spec")
    status = body.get("status")
    return OffloadNode(
        name=name,
        status=NodeInventory.from_status(status if isinstance(status, Mapping) else {}),
        reclaims=parse_reclaim_requests(spec if isinstance(spec, Mapping) else None),
        retained=parse_retained(spec if isinstance(spec, Mapping) else None),
    )
