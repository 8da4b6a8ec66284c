"""The status contract between agent and operator: each record the agent writes and the operator
reads, defined once, with the one mapping to and from the resource's JSON. This module holds
OffloadRegion's per-node reports; kvshm.api.offload_node the OffloadNode records;
kvshm.api.reading the lenient, bounded reading both use.

| record | where it lives | written by | read by |
|---|---|---|---|
| NodeReport | OffloadRegion status.nodes.<node> | that node's agent | operator |
| WarmIndexReport | OffloadRegion status.nodes.<node>.warmIndex | that node's agent | people |
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

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from kvshm.api.address import NodeName
from kvshm.api.messages import MAX_STATUS_MESSAGE, bounded, printable
from kvshm.api.offload_region import NodeRegionPhase, WarmIndexState
from kvshm.api.reading import (
    MAX_INT64,
    MAX_REPORT_PATH,
    format_timestamp,
    keep_field,
    maybe_whole_seconds,
    parse_timestamp,
    read_count,
    read_int,
    read_str,
)

# --- OffloadRegion status.nodes.<node> -------------------------------------------------------


@dataclass(frozen=True)
class WarmIndexReport:
    """OffloadRegion status.nodes.<node>.warmIndex: what the last engine that started on the
    region made of its warm-restart index (docs/warm-restart.md), as the agent read it from the
    index's header. The engine writes it there (it cannot write the OffloadRegion); the reason
    is the tenant's file's text, bounded, and says nothing the tenant could not say anyway."""

    state: WarmIndexState | None  # None: a state this reader does not know (a newer agent's)
    reason: str = ""  # why it started cold (or what a warm start discarded)
    chunks: int = 0  # chunks the engine started with
    started: datetime | None = None  # when the engine made it

    def __post_init__(self) -> None:
        # the tenant's words: escaped (a lone surrogate fails the API write), then bounded
        keep_field(self, "reason", bounded(printable(self.reason), MAX_STATUS_MESSAGE))
        keep_field(self, "chunks", min(read_count(self.chunks), MAX_INT64))
        keep_field(self, "started", maybe_whole_seconds(self.started))

    def to_status(self) -> dict[str, Any]:
        if self.state is None:
            raise ValueError("a warm index of an unknown state cannot be written")
        return {  # every key, null included: a merge patch keeps the keys it does not name
            "state": self.state.value,
            "reason": self.reason,
            "chunks": self.chunks,
            "startedAt": format_timestamp(self.started) if self.started is not None else None,
        }

    @classmethod
    def from_status(cls, entry: object) -> WarmIndexReport | None:
        if not isinstance(entry, Mapping):
            return None
        try:
            state: WarmIndexState | None = WarmIndexState(str(entry.get("state")))
        except ValueError:
            state = None
        return cls(
            state=state,
            reason=read_str(entry.get("reason"), MAX_STATUS_MESSAGE),
            chunks=read_count(entry.get("chunks")),
            started=parse_timestamp(entry.get("startedAt")),
        )


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
    warm_index: WarmIndexReport | None = None  # Ready regions: the index's state, once read

    def __post_init__(self) -> None:
        keep_field(self, "message", bounded(self.message, MAX_STATUS_MESSAGE))
        if self.populate_seconds is not None:
            keep_field(self, "populate_seconds", round(self.populate_seconds, 3))
        keep_field(self, "last_transition_time", maybe_whole_seconds(self.last_transition_time))

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
            "warmIndex": self.warm_index.to_status() if self.warm_index is not None else None,
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
            path=read_str(entry.get("path"), MAX_REPORT_PATH),
            size_bytes=read_count(entry.get("sizeBytes")),
            populated_bytes=read_count(entry.get("populatedBytes")),
            locked=entry.get("locked") is True,
            populate_seconds=(
                float(seconds)
                if isinstance(seconds, int | float) and not isinstance(seconds, bool)
                else None
            ),
            holders=read_int(entry.get("holders")),
            message=read_str(entry.get("message"), MAX_STATUS_MESSAGE),
            observed_generation=read_count(entry.get("observedGeneration")),
            files=read_count(entry.get("fileCount")),
            last_transition_time=parse_timestamp(entry.get("lastTransitionTime")),
            warm_index=WarmIndexReport.from_status(entry.get("warmIndex")),
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
