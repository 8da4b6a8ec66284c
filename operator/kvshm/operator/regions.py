"""What the operator owes one region now: its finalizer, a status write (at once or a little
later), its release, and the Events that go with them. One pure function (plan_region) of the
region as last seen and the cluster, so an event, the resync and a restarted operator decide
the same, and the status already written is the memory of what was announced.

Writes are what the API server and etcd pay for (docs/operator.md, the write budget), so:
- the finalizer is added in the first reconcile and removed at release, one write each;
- a status on the way (Pending, Provisioning, Terminating) waits `progress_write_seconds` for
  the next report, and is written then only if its phase, counts or conditions changed: an
  agent that reports Ready within the wait makes that write needless (and the book writes at
  most one such status per `region_resync_seconds`);
- a status that settles (Ready, Degraded, Failed), or leaves one of those, is written at once;
- nothing is written at release but the finalizer: the object is about to go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvshm.api import (
    ReclaimPolicy,
    RegionPhase,
    SpecError,
    parse_node_reports,
    parse_offload_region,
)
from kvshm.api.conditions import ConditionType
from kvshm.api.events import EventReason
from kvshm.operator.announcements import Announcement
from kvshm.operator.cluster import ClusterSnapshot
from kvshm.operator.deletion import decide_release
from kvshm.operator.phases import (
    ANNOUNCED_PHASES,
    RegionStatus,
    derive_invalid,
    derive_status,
    status_patch,
)

SETTLED = frozenset(phase.value for phase in ANNOUNCED_PHASES)


@dataclass(frozen=True)
class RegionPlan:
    derived: RegionStatus | None = None  # None: the region is not the operator's to handle
    add_finalizer: bool = False
    status: Mapping[str, Any] | None = None  # a merge patch of status; None: nothing to write
    write_now: bool = True  # False: after progress_write_seconds, decided again then
    release: bool = False  # remove the finalizer
    retained: tuple[str, ...] = ()  # Retain: nodes whose files stay (recorded before release)
    announcements: tuple[Announcement, ...] = ()  # posted once the write above is made


def derive(body: Mapping[str, Any], cluster: ClusterSnapshot) -> RegionStatus:
    meta = body.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    try:
        region = parse_offload_region(body)
    except SpecError as exc:
        return derive_invalid(f"invalid OffloadRegion: {exc}", generation)
    deleting = bool(meta.get("deletionTimestamp"))
    return derive_status(region, parse_node_reports(body.get("status")), cluster, deleting)


def plan_region(
    body: Mapping[str, Any], cluster: ClusterSnapshot, finalizer: str, now: datetime
) -> RegionPlan:
    meta = body.get("metadata") or {}
    ours = finalizer in (meta.get("finalizers") or ())
    deleting = bool(meta.get("deletionTimestamp"))
    if deleting and not ours:
        return RegionPlan()  # released already, or never held: nothing left to decide
    derived = derive(body, cluster)
    current: Mapping[str, Any] = body.get("status") or {}
    if deleting:
        return _plan_deletion(body, derived, current, cluster, now)
    changes = status_patch(current, derived, now)
    settled = derived.phase.value in SETTLED or current.get("phase") in SETTLED
    worth = bool(changes) if settled else _signature(current) != _signature({**current, **changes})
    if worth and "kopf" in current:
        changes["kopf"] = None  # an earlier operator's kopf records, dropped in a write anyway
    return RegionPlan(
        derived=derived,
        add_finalizer=not ours,
        status=changes if worth else None,
        write_now=settled,
        announcements=_announcements(current, derived) if worth else (),
    )


def _plan_deletion(
    body: Mapping[str, Any],
    derived: RegionStatus,
    current: Mapping[str, Any],
    cluster: ClusterSnapshot,
    now: datetime,
) -> RegionPlan:
    spec_policy = (body.get("spec") or {}).get("reclaimPolicy")
    policy = (
        ReclaimPolicy.RETAIN if spec_policy == ReclaimPolicy.RETAIN.value else ReclaimPolicy.DELETE
    )
    decision = decide_release(policy, parse_node_reports(body.get("status")), cluster)
    if decision.release:
        notes = (
            [Announcement(False, EventReason.RETAINED, decision.summary)]
            if decision.retained
            else []
        )
        notes += [
            Announcement(True, item.reason.value, f"released anyway: {item.message}")
            for item in decision.abandoned
        ]
        return RegionPlan(
            derived=derived, release=True, retained=decision.retained, announcements=tuple(notes)
        )
    changes = status_patch(current, derived, now)
    worth = _signature(current) != _signature({**current, **changes}) or "nodes" in changes
    return RegionPlan(derived=derived, status=changes if worth else None, write_now=False)


def _signature(status: Mapping[str, Any]) -> tuple[object, ...]:
    """What a status on the way is written for: not its message, nor which node got how far."""
    conditions = tuple(
        (item.get("type"), item.get("status"), item.get("reason"))
        for item in status.get("conditions") or ()
    )
    return (
        status.get("phase"),
        status.get("observedGeneration"),
        status.get("nodesWanted"),
        status.get("sizeBytes"),
        conditions,
        tuple(sorted(node for node, entry in (status.get("nodes") or {}).items() if entry)),
    )


def _announcements(current: Mapping[str, Any], derived: RegionStatus) -> tuple[Announcement, ...]:
    """Events of this write: a phase reached or left that users act on, a refused spec (once
    per generation: the written status remembers it), nodes dropped from status.nodes."""
    notes = []
    accepted = derived.condition(ConditionType.ACCEPTED)
    if accepted is not None and accepted.status is False:
        shown: Mapping[str, Any] = next(
            (c for c in current.get("conditions") or () if c.get("type") == "Accepted"), {}
        )
        same_generation = current.get("observedGeneration") == derived.observed_generation
        if not (same_generation and shown.get("status") == "False"):
            notes.append(Announcement(True, accepted.reason, accepted.message))
    previous = current.get("phase")
    if previous != derived.phase.value and derived.phase in ANNOUNCED_PHASES:
        warning = derived.phase in (RegionPhase.FAILED, RegionPhase.DEGRADED)
        message = f"{previous or 'new'} -> {derived.phase.value}: {derived.message}"
        notes.append(Announcement(warning, derived.phase.value, message))
    reported = current.get("nodes") or {}
    for node in derived.gone_nodes:
        if reported.get(node):
            notes.append(
                Announcement(
                    True,
                    EventReason.NODE_GONE,
                    f"node {node} no longer exists and its agent is silent: "
                    "dropped it from status.nodes",
                )
            )
    return tuple(notes)
