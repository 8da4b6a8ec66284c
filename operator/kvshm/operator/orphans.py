"""Which files in a node's inventory to reclaim: orphans that stayed orphaned past a grace period.

An orphan is a region-shaped file that no OffloadRegion claims and that no live process holds.
A reclaim is requested only for a file that has been an orphan *continuously* for the grace
period: any moment it is claimed or held restarts its clock. Two views of "claimed" are both
honoured — the agent's (claimedBy) and the operator's own (the paths of every region it
knows) — so a disagreement refuses rather than deletes. The clock lives in the operator's
memory: a restart starts it again, which can only delay a reclaim, never hasten one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from kvshm.operator.reports import InventoryFile, NodeInventory, ReclaimResult


class Refusal(StrEnum):
    """Why a file that looked reclaimable was not requested (the metric's reason label)."""

    HELD = "held"
    CLAIMED = "claimed"
    GRACE = "grace"


@dataclass(frozen=True)
class OrphanClock:
    """Per-node memory between sweeps."""

    since: Mapping[str, datetime] = field(default_factory=dict)  # path -> orphaned since
    refused: Mapping[str, Refusal] = field(default_factory=dict)  # path -> last refusal
    dry_run_reported: frozenset[str] = frozenset()  # paths already announced in dry-run


@dataclass(frozen=True)
class ReclaimRequest:
    path: str
    size_bytes: int
    orphaned_since: datetime


@dataclass(frozen=True)
class Refused:
    path: str
    reason: Refusal
    message: str


@dataclass(frozen=True)
class OrphanDecision:
    clock: OrphanClock
    orphans: tuple[InventoryFile, ...] = ()  # unclaimed and unheld right now
    requests: tuple[ReclaimRequest, ...] = ()  # to write into spec.reclaims now
    would_reclaim: tuple[ReclaimRequest, ...] = ()  # dry run: announced, not requested
    withdrawals: tuple[Refused, ...] = ()  # pending requests that are no longer safe
    refusals: tuple[Refused, ...] = ()  # refusals that started with this sweep
    results: tuple[ReclaimResult, ...] = ()  # agent answers to pending requests: close them
    forget_retained: tuple[str, ...] = ()  # spec.retained entries that no longer apply

    @property
    def orphaned_bytes(self) -> int:
        return sum(item.size_bytes for item in self.orphans)


def _unsafe(item: InventoryFile, claimed_paths: frozenset[str]) -> tuple[Refusal, str] | None:
    if item.claimed_by:
        return Refusal.CLAIMED, f"{item.path} is claimed by region {item.claimed_by}"
    if item.path in claimed_paths:
        return Refusal.CLAIMED, f"{item.path} is the file of an existing OffloadRegion"
    if item.held:
        return Refusal.HELD, f"{item.path} is held open or mapped by a live process"
    return None


def _claimed_by_another(inventory: NodeInventory, path: str, retained_for: object) -> bool:
    """Whether the agent reports the file claimed by a region other than the one it was
    retained for. The deleted region's own claim stays in the inventory until its agent
    catches up, and must not undo the retention it just asked for."""
    return any(
        item.path == path and item.claimed_by and item.claimed_by != retained_for
        for item in inventory.files
    )


def decide_reclaims(
    inventory: NodeInventory,
    claimed_paths: Iterable[str],
    clock: OrphanClock,
    now: datetime,
    grace_seconds: float,
    dry_run: bool = False,
    live_paths: Iterable[str] = (),
) -> OrphanDecision:
    """One sweep over one node's inventory. Pure: the new clock is part of the decision.

    claimed_paths are the files of every OffloadRegion, deleting ones included (none of them
    is an orphan); live_paths those of regions not being deleted (a retained file one of them
    claims is in use again)."""
    claimed = frozenset(claimed_paths)
    live = frozenset(live_paths)
    pending = inventory.reclaim_requests.keys()
    answered = {result.path: result for result in inventory.reclaim_results}
    since: dict[str, datetime] = {}
    refused: dict[str, Refusal] = {}
    orphans, requests, would, withdrawals, refusals = [], [], [], [], []
    reported = set()
    present = {item.path for item in inventory.files}

    for item in inventory.files:
        unsafe = _unsafe(item, claimed)
        if unsafe is not None:
            reason, message = unsafe
            refused[item.path] = reason
            if item.path in pending and item.path not in answered:
                withdrawals.append(Refused(item.path, reason, message))
            elif not item.claimed_by and clock.refused.get(item.path) is not reason:
                # A file the agent itself calls claimed is normal, not a decision; anything
                # else that looked reclaimable but cannot be taken is one, refused as unsafe.
                refusals.append(Refused(item.path, reason, message))
            continue
        orphans.append(item)
        if item.path in inventory.retained:
            continue  # kept on purpose (reclaimPolicy Retain) until an admin releases it
        started = clock.since.get(item.path, now)
        since[item.path] = started
        if item.path in pending:
            continue
        waited = (now - started).total_seconds()
        if waited < grace_seconds:
            refused[item.path] = Refusal.GRACE
            if clock.refused.get(item.path) is not Refusal.GRACE:
                refusals.append(
                    Refused(
                        item.path,
                        Refusal.GRACE,
                        f"{item.path} is an orphan since {waited:.0f}s; reclaim after "
                        f"{grace_seconds:.0f}s if it stays one",
                    )
                )
            continue
        request = ReclaimRequest(item.path, item.size_bytes, started)
        if dry_run:
            reported.add(item.path)
            if item.path not in clock.dry_run_reported:
                would.append(request)
        else:
            requests.append(request)

    return OrphanDecision(
        clock=OrphanClock(since, refused, frozenset(reported)),
        orphans=tuple(orphans),
        requests=tuple(requests),
        would_reclaim=tuple(would),
        withdrawals=tuple(withdrawals),
        refusals=tuple(refusals),
        results=tuple(answered[path] for path in sorted(pending & answered.keys())),
        forget_retained=tuple(
            sorted(
                path
                for path, entry in inventory.retained.items()
                if path not in present
                or path in live
                or _claimed_by_another(inventory, path, entry.get("region"))
            )
        ),
    )
