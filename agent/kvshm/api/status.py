"""The status contract between agent and operator: each record the agent writes and the operator
reads, defined once, with the one mapping to and from the resource's JSON.

| record | where it lives | written by | read by |
|---|---|---|---|
| NodeReport | OffloadRegion status.nodes.<node> | that node's agent | operator |
| NodeInventory | OffloadNode status | that node's agent | operator |
| InventoryFile | OffloadNode status.files[] | agent | operator |
| ReclaimResult | OffloadNode status.reclaims[] | agent | operator |
| ReclaimRequest | OffloadNode spec.reclaims[] | operator | agent |
| RetainedFile | OffloadNode spec.retained[] | operator | operator |
| OffloadNode | the whole OffloadNode | | operator |

`to_status()` gives exactly what the CRD schema keeps (charts/kvshm/crds), so a record read back
from the API server with `from_status()` equals the one written: the records hold values at the
precision status keeps (whole-second times, populateSeconds to the millisecond, messages cut to
their bound). Reading is lenient and bounded: a missing or malformed field reads as its safe
default (a file whose `held` is unknown counts as held, an unreadable time as none), so a bad
report can delay a decision but never cause an unsafe one, and nothing read is larger than the
schema allows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kvshm.api.address import NodeName
from kvshm.api.messages import MAX_STATUS_MESSAGE, bounded
from kvshm.api.resources import NodeRegionPhase, ReclaimOutcome

# maxItems of the OffloadNode lists (the CRD's): more entries are not read
MAX_INVENTORY_FILES = 10000
MAX_RECLAIMS = 1000
MAX_RETAINED = 10000
MAX_PATH = 1024  # maxLength of every path in OffloadNode
MAX_REPORT_PATH = 4096  # maxLength of status.nodes.<node>.path
MAX_AGENT_VERSION = 128
MAX_REASON = 1024  # maxLength of spec.reclaims[].reason
MAX_REGION_KEY = 317  # maxLength of claimedBy and retained[].region: <namespace>/<name>


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC to the second, the way Kubernetes writes timestamps."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: object) -> datetime | None:
    """An RFC 3339 timestamp as Kubernetes writes it ('2026-01-02T03:04:05Z'), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return whole_seconds(parsed)


def whole_seconds(moment: datetime) -> datetime:
    """The moment in UTC without its fraction of a second: what a status timestamp keeps."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).replace(microsecond=0)


def _maybe_whole_seconds(moment: datetime | None) -> datetime | None:
    return None if moment is None else whole_seconds(moment)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value: object) -> int:
    """A non-negative integer field; anything else reads as 0."""
    number = _int(value)
    return number if number is not None and number >= 0 else 0


def _str(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _keep(record: object, name: str, value: object) -> None:
    object.__setattr__(record, name, value)  # normalising a frozen record in __post_init__


def _entries(value: object, limit: int) -> list[Mapping[str, Any]]:
    """The entries of a list-map keyed by path (the CRDs' form), at most `limit`, each path
    once (the first wins); a plain map path -> entry is read the same way."""
    if isinstance(value, Mapping):
        value = [
            {**entry, "path": path} for path, entry in value.items() if isinstance(entry, Mapping)
        ]
    if not isinstance(value, list):
        return []
    seen: set[str] = set()
    entries: list[Mapping[str, Any]] = []
    for entry in value:
        if len(entries) >= limit:
            break
        if not isinstance(entry, Mapping):
            continue
        path = entry.get("path")
        if isinstance(path, str) and path and len(path) <= MAX_PATH and path not in seen:
            seen.add(path)
            entries.append(entry)
    return entries


# --- OffloadRegion status.nodes.<node> -------------------------------------------------------


@dataclass(frozen=True)
class NodeReport:
    """OffloadRegion status.nodes.<node>: what that node's agent did with the region."""

    phase: NodeRegionPhase | None  # None: a phase this reader does not know (a newer agent's)
    path: str = ""  # file 0's absolute path on the node
    size_bytes: int = 0
    populated_bytes: int = 0
    locked: bool = False
    populate_seconds: float | None = None
    holders: int | None = None  # processes holding the file's shared flock, when known
    message: str = ""
    # metadata.generation of the spec this report is about: Ready counts only for the
    # region's current generation (ready_for); 0 when a report does not say
    observed_generation: int = 0
    files: int = 0  # the region's files (vllm_offload_<id>.mmap, .mmap.1, ...), once known
    last_transition_time: datetime | None = None  # when phase last changed (the sink sets it)

    def __post_init__(self) -> None:
        _keep(self, "message", bounded(self.message, MAX_STATUS_MESSAGE))
        if self.populate_seconds is not None:
            _keep(self, "populate_seconds", round(self.populate_seconds, 3))
        _keep(self, "last_transition_time", _maybe_whole_seconds(self.last_transition_time))

    @property
    def phase_name(self) -> str:
        return self.phase.value if self.phase is not None else "Unknown"

    def ready_for(self, generation: int) -> bool:
        """Ready, and for this generation of the spec: a report of an older one (or one that
        does not say) is stale, whatever it says."""
        return self.phase is NodeRegionPhase.READY and self.observed_generation >= generation

    @property
    def holds_files(self) -> bool:
        """Whether the node may still have the region's files (anything but Removed; an
        unknown phase too)."""
        return self.phase is not NodeRegionPhase.REMOVED

    def differs_only_in_progress(self, other: NodeReport) -> bool:
        """Whether the two differ in nothing but progress (populated bytes, holder count),
        which is published at most about once a second."""
        return replace(other, populated_bytes=self.populated_bytes, holders=self.holders) == self

    def to_status(self) -> dict[str, Any]:
        if self.phase is None:
            raise ValueError("a report of an unknown phase cannot be written")
        status: dict[str, Any] = {
            "phase": self.phase.value,
            "path": self.path,
            "sizeBytes": self.size_bytes,
            "fileCount": self.files,
            "populatedBytes": self.populated_bytes,
            "locked": self.locked,
            "message": self.message,
            # null, not absent: a merge patch leaves absent keys as an earlier phase set them
            "populateSeconds": self.populate_seconds,
            "holders": self.holders,
            "observedGeneration": self.observed_generation,
        }
        if self.last_transition_time is not None:
            status["lastTransitionTime"] = format_timestamp(self.last_transition_time)
        return status

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> NodeReport:
        try:
            phase: NodeRegionPhase | None = NodeRegionPhase(str(entry.get("phase")))
        except ValueError:
            phase = None
        seconds = entry.get("populateSeconds")
        return cls(
            phase=phase,
            path=_str(entry.get("path"), MAX_REPORT_PATH),
            size_bytes=_count(entry.get("sizeBytes")),
            populated_bytes=_count(entry.get("populatedBytes")),
            locked=entry.get("locked") is True,
            populate_seconds=(
                float(seconds)
                if isinstance(seconds, int | float) and not isinstance(seconds, bool)
                else None
            ),
            holders=_int(entry.get("holders")),
            message=_str(entry.get("message"), MAX_STATUS_MESSAGE),
            observed_generation=_count(entry.get("observedGeneration")),
            files=_count(entry.get("fileCount")),
            last_transition_time=parse_timestamp(entry.get("lastTransitionTime")),
        )


def parse_node_reports(status: Mapping[str, Any] | None) -> dict[str, NodeReport]:
    """status.nodes of an OffloadRegion, by node: each key is a NodeName (an entry under any
    other key is left out)."""
    nodes = (status or {}).get("nodes")
    if not isinstance(nodes, Mapping):
        return {}
    reports: dict[str, NodeReport] = {}
    for key, entry in nodes.items():
        node = NodeName.parse(key)
        if node is not None and isinstance(entry, Mapping):
            reports[node] = NodeReport.from_status(entry)
    return reports


# --- OffloadNode status ----------------------------------------------------------------------


@dataclass(frozen=True)
class InventoryFile:
    """One region found under a node's region root (all its files as one entry)."""

    path: str  # relative to the root: <namespace>/<name>/vllm_offload_<id>.mmap (file 0)
    size_bytes: int  # of all its files
    claimed_by: str  # "<namespace>/<name>" of the region that names this file, or ""
    held: bool  # a process other than the agent holds it (unknown counts as held)
    age_seconds: int = 0  # since its newest file was last written
    # when the agent first saw it unclaimed (kept over agent restarts); the operator's orphan
    # grace period counts from it, so it survives operator restarts too. None while claimed.
    first_seen_unclaimed: datetime | None = None
    files: int = 1  # vllm_offload_<id>.mmap and its .mmap.<i> files

    def __post_init__(self) -> None:
        _keep(self, "age_seconds", int(self.age_seconds))
        _keep(self, "first_seen_unclaimed", _maybe_whole_seconds(self.first_seen_unclaimed))

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "path": self.path,
            "sizeBytes": self.size_bytes,
            "fileCount": self.files,
            "claimedBy": self.claimed_by,
            "held": self.held,
            "ageSeconds": self.age_seconds,
        }
        if self.first_seen_unclaimed is not None:
            status["firstSeenUnclaimed"] = format_timestamp(self.first_seen_unclaimed)
        return status

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> InventoryFile:
        files = _int(entry.get("fileCount"))
        return cls(
            path=_str(entry.get("path"), MAX_PATH),
            size_bytes=_count(entry.get("sizeBytes")),
            claimed_by=_str(entry.get("claimedBy"), MAX_REGION_KEY),
            held=entry.get("held") is not False,
            age_seconds=_count(entry.get("ageSeconds")),
            first_seen_unclaimed=parse_timestamp(entry.get("firstSeenUnclaimed")),
            files=files if files is not None and files >= 0 else 1,
        )


@dataclass(frozen=True)
class ReclaimResult:
    """The agent's answer to one reclaim request (OffloadNode status.reclaims[])."""

    path: str
    outcome: ReclaimOutcome
    message: str = ""
    time: datetime | None = None

    def __post_init__(self) -> None:
        _keep(self, "message", bounded(self.message, MAX_STATUS_MESSAGE))
        _keep(self, "time", _maybe_whole_seconds(self.time))

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
            path=_str(entry.get("path"), MAX_PATH),
            outcome=ReclaimOutcome.from_status(entry.get("outcome")),
            message=_str(entry.get("message"), MAX_STATUS_MESSAGE),
            time=parse_timestamp(entry.get("time")),
        )


@dataclass(frozen=True)
class NodeInventory:
    """OffloadNode status, written by its agent only (less conditions: the agent's RootSafe
    condition is for people; no decision reads it)."""

    capacity_bytes: int | None = None  # None until the agent has measured its root
    free_bytes: int | None = None
    reserve_bytes: int = 0
    files: tuple[InventoryFile, ...] = ()
    reclaims: tuple[ReclaimResult, ...] = ()
    heartbeat: datetime | None = None
    agent_version: str = ""

    def __post_init__(self) -> None:
        _keep(self, "heartbeat", _maybe_whole_seconds(self.heartbeat))

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
        return status

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> NodeInventory:
        capacity = _int(status.get("capacityBytes"))
        free = _int(status.get("freeBytes"))
        return cls(
            capacity_bytes=capacity if capacity is not None and capacity >= 0 else None,
            free_bytes=free if free is not None and free >= 0 else None,
            reserve_bytes=_count(status.get("reserveBytes")),
            files=tuple(
                InventoryFile.from_status(e)
                for e in _entries(status.get("files"), MAX_INVENTORY_FILES)
            ),
            reclaims=tuple(
                ReclaimResult.from_status(e) for e in _entries(status.get("reclaims"), MAX_RECLAIMS)
            ),
            heartbeat=parse_timestamp(status.get("heartbeat")),
            agent_version=_str(status.get("agentVersion"), MAX_AGENT_VERSION),
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
        _keep(self, "reason", bounded(self.reason, MAX_REASON))
        _keep(self, "requested_at", _maybe_whole_seconds(self.requested_at))

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
        size = _int(entry.get("sizeBytes"))
        return cls(
            path=_str(entry.get("path"), MAX_PATH),
            size_bytes=size if size is not None and size >= 0 else None,
            requested_at=parse_timestamp(entry.get("requestedAt")),
            reason=_str(entry.get("reason"), MAX_REASON),
        )


@dataclass(frozen=True)
class RetainedFile:
    """A file kept on purpose (OffloadNode spec.retained[]): its region was deleted with
    reclaimPolicy Retain, and orphan reclaim leaves it alone until the entry goes."""

    path: str
    region: str = ""  # <namespace>/<name> of the deleted region
    retained_at: datetime | None = None

    def __post_init__(self) -> None:
        _keep(self, "retained_at", _maybe_whole_seconds(self.retained_at))

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
            path=_str(entry.get("path"), MAX_PATH),
            region=_str(entry.get("region"), MAX_REGION_KEY),
            retained_at=parse_timestamp(entry.get("retainedAt")),
        )


def parse_reclaim_requests(spec: Mapping[str, Any] | None) -> tuple[ReclaimRequest, ...]:
    entries = _entries((spec or {}).get("reclaims"), MAX_RECLAIMS)
    return tuple(ReclaimRequest.from_spec(entry) for entry in entries)


def parse_retained(spec: Mapping[str, Any] | None) -> tuple[RetainedFile, ...]:
    entries = _entries((spec or {}).get("retained"), MAX_RETAINED)
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
