"""Which files in a node's inventory to reclaim: orphans that stayed orphaned past a grace period.

An orphan is a region-shaped file that no OffloadRegion claims and that no live process holds.
A reclaim is requested only for a file that has been an orphan *continuously* for the grace
period. Two views of "claimed" are both honoured — the agent's (claimedBy) and the operator's
own (the paths of every region it knows) — so a disagreement refuses rather than deletes.

Where the orphan's time starts:
- the agent's `orphanedSince` (kept by the agent over its restarts, reset by it whenever a
  region claims the file or a process holds it, rounded up to a whole second): the grace
  period survives operator restarts;
- unless this operator saw the file held or claimed since then, between two of the agent's
  scans: its time starts again when the operator next sees it an orphan. That memory is the
  operator's; after a restart only the agent's time is left, and the agent checks holders
  again before it removes anything;
- without `orphanedSince` (an agent that does not publish it), when this operator first
  saw it an orphan.
Times are compared across machines, as heartbeats are: the clocks must be synchronised.

What is written is bounded: at most MAX_RECLAIMS requests pending per node (the CRD's
maxItems), the oldest orphans first. An agent's answer closes only the request it answers
(not an earlier one's, still in its status), and after an answer other than Done the file waits
a doubling time before it is requested again (RetryWait; lost on restart, as the rest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from kvshm.api import InventoryFile, OffloadNode, ReclaimOutcome, ReclaimRequest, ReclaimResult
from kvshm.api.events import EventReason
from kvshm.api.reading import MAX_RECLAIMS, format_timestamp
from kvshm.operator.announcements import Announcement
from kvshm.operator.backoff import backoff_seconds

# After an answer other than Done (the agent could not, or would not, remove the file), the
# same file is requested again only after a wait that doubles with each such answer in a row.
RECLAIM_RETRY_FIRST_SECONDS = 60.0
RECLAIM_RETRY_MAX_SECONDS = 3600.0
# An answer's time (the agent's clock) may read this much before its request's (the operator's)
# and still answer it; an earlier request's answer is older by a retry wait at least.
ANSWER_CLOCK_SKEW_SECONDS = 5.0


class Refusal(StrEnum):
    """Why a file that looked reclaimable was not requested (the metric's reason label)."""

    HELD = "held"
    CLAIMED = "claimed"
    GRACE = "grace"


@dataclass(frozen=True)
class RetryWait:
    """A file whose reclaim the agent answered other than Done: not requested before `until`."""

    failures: int  # such answers in a row
    until: datetime
    answer: ReclaimResult  # the last one (seen again while the spec catches up: not counted)

    @classmethod
    def after(cls, answer: ReclaimResult, previous: RetryWait | None, now: datetime) -> RetryWait:
        if previous is not None and previous.answer == answer:
            return previous
        failures = (previous.failures if previous is not None else 0) + 1
        wait = backoff_seconds(RECLAIM_RETRY_FIRST_SECONDS, failures - 1, RECLAIM_RETRY_MAX_SECONDS)
        return cls(failures, now + timedelta(seconds=wait), answer)


@dataclass(frozen=True)
class OrphanClock:
    """Per-node memory between sweeps (lost on restart: see the module's docstring)."""

    since: Mapping[str, datetime] = field(default_factory=dict)  # path -> orphaned since
    refused: Mapping[str, Refusal] = field(default_factory=dict)  # path -> last refusal
    dry_run_reported: frozenset[str] = frozenset()  # paths already announced in dry-run
    retry: Mapping[str, RetryWait] = field(default_factory=dict)  # path -> after a non-Done


@dataclass(frozen=True)
class DueReclaim:
    """An orphan past its grace period: the decision behind one spec.reclaims entry."""

    path: str
    size_bytes: int
    orphaned_since: datetime

    def request(self, now: datetime) -> ReclaimRequest:
        return ReclaimRequest(
            self.path,
            self.size_bytes,
            requested_at=now,
            reason=f"orphaned since {format_timestamp(self.orphaned_since)}: no OffloadRegion "
            "claims it and no process holds it",
        )


@dataclass(frozen=True)
class Refused:
    path: str
    reason: Refusal
    message: str


@dataclass(frozen=True)
class OrphanDecision:
    clock: OrphanClock
    orphans: tuple[InventoryFile, ...] = ()  # unclaimed and unheld right now
    requests: tuple[DueReclaim, ...] = ()  # to write into spec.reclaims now
    deferred: tuple[DueReclaim, ...] = ()  # due, but spec.reclaims is full: a later sweep's
    would_reclaim: tuple[DueReclaim, ...] = ()  # dry run: announced, not requested
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


def _claimed_by_another(node: OffloadNode, path: str, retained_for: str) -> bool:
    """Whether the agent reports the file claimed by a region other than the one it was
    retained for. The deleted region's own claim stays in the inventory until its agent
    catches up, and must not undo the retention it just asked for."""
    return any(
        item.path == path and item.claimed_by and item.claimed_by != retained_for
        for item in node.status.files
    )


def _orphaned_since(item: InventoryFile, clock: OrphanClock, now: datetime) -> datetime:
    """When the file's time as an orphan started (the module's docstring says why)."""
    if item.path in clock.since:  # an orphan at the last sweep too
        known = clock.since[item.path]
        agent = item.orphaned_since
        # a claim or holder the agent saw between two sweeps restarted its time: the later
        return max(known, agent) if agent is not None else known
    if clock.refused.get(item.path) in (Refusal.HELD, Refusal.CLAIMED):
        return now  # held or claimed at the last sweep: an orphan from now on
    return item.orphaned_since or now


def _answers(result: ReclaimResult, request: ReclaimRequest) -> bool:
    """Whether result answers this request, not an earlier one of the same path (whose result
    the agent's status can still show when a new request is written): the agent answers at
    or after the request's time. Without either time, a result is taken as the answer."""
    if result.time is None or request.requested_at is None:
        return True
    return result.time >= request.requested_at - timedelta(seconds=ANSWER_CLOCK_SKEW_SECONDS)


def _retry_after(
    results: Iterable[ReclaimResult], known: Mapping[str, RetryWait], now: datetime
) -> dict[str, RetryWait]:
    """The waits after this sweep's answers: one more failure for each answer but Done."""
    retry = dict(known)
    for result in results:
        if result.outcome is ReclaimOutcome.DONE:
            retry.pop(result.path, None)
        else:
            retry[result.path] = RetryWait.after(result, known.get(result.path), now)
    return retry


def decide_reclaims(
    node: OffloadNode,
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
    claimed = frozenset(claimed_paths)  # the same object where a frozenset is passed
    live = frozenset(live_paths)
    requested = {request.path: request for request in node.reclaims}
    pending = requested.keys()
    answered = {
        result.path: result
        for result in node.status.reclaims
        if result.path in requested and _answers(result, requested[result.path])
    }
    retry = _retry_after(answered.values(), clock.retry, now)
    since: dict[str, datetime] = {}
    refused: dict[str, Refusal] = {}
    orphans, requests, would, withdrawals, refusals = [], [], [], [], []
    reported = set()
    present = {item.path for item in node.status.files}
    retained = {entry.path: entry for entry in node.retained}

    for item in node.status.files:
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
        if item.path in retained:
            continue  # kept on purpose (reclaimPolicy Retain) until an admin releases it
        started = _orphaned_since(item, clock, now)
        since[item.path] = started
        if item.path in pending:
            continue
        if item.path in retry and now < retry[item.path].until:
            continue  # the agent did not remove it the last time: wait before asking again
        waited = max(0.0, (now - started).total_seconds())
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
        request = DueReclaim(item.path, item.size_bytes, started)
        if dry_run:
            reported.add(item.path)
            if item.path not in clock.dry_run_reported:
                would.append(request)
        else:
            requests.append(request)

    closed = {w.path for w in withdrawals} | answered.keys()
    room = max(0, MAX_RECLAIMS - len(pending - closed))
    orphan_paths = {item.path for item in orphans}
    # the oldest orphans first; the CRD refuses a longer list (and the whole write with it)
    requests.sort(key=lambda due: (due.orphaned_since, due.path))
    return OrphanDecision(
        clock=OrphanClock(
            since,
            refused,
            frozenset(reported),
            {path: wait for path, wait in retry.items() if path in orphan_paths},
        ),
        orphans=tuple(orphans),
        requests=tuple(requests[:room]),
        deferred=tuple(requests[room:]),
        would_reclaim=tuple(would),
        withdrawals=tuple(withdrawals),
        refusals=tuple(refusals),
        results=tuple(answered[path] for path in sorted(answered)),
        forget_retained=tuple(
            sorted(
                path
                for path, entry in retained.items()
                if path not in present
                or path in live
                or _claimed_by_another(node, path, entry.region)
            )
        ),
    )


def announcements(decision: OrphanDecision) -> tuple[Announcement, ...]:
    """The Events a sweep's decision owes its OffloadNode: requests, dry-run findings, refusals
    that started (a grace period is not news), withdrawals and the agents' answers."""
    notes = [
        Announcement(
            False,
            EventReason.RECLAIM_REQUESTED,
            f"{due.path} ({due.size_bytes} bytes) is an orphan since "
            f"{format_timestamp(due.orphaned_since)}: asked the agent to reclaim it",
        )
        for due in decision.requests
    ]
    notes.extend(
        Announcement(
            False,
            EventReason.WOULD_RECLAIM,
            f"dry run: {due.path} ({due.size_bytes} bytes) is an orphan past the grace period "
            "and would be reclaimed",
        )
        for due in decision.would_reclaim
    )
    notes.extend(
        Announcement(False, EventReason.RECLAIM_NOT_REQUESTED, refused.message)
        for refused in decision.refusals
        if refused.reason is not Refusal.GRACE
    )
    notes.extend(
        Announcement(
            True,
            EventReason.RECLAIM_WITHDRAWN,
            f"withdrew the reclaim request: {withdrawn.message}",
        )
        for withdrawn in decision.withdrawals
    )
    for result in decision.results:
        if result.outcome is ReclaimOutcome.DONE:
            notes.append(
                Announcement(
                    False, EventReason.RECLAIM_COMPLETED, f"the agent reclaimed {result.path}"
                )
            )
        else:
            message = f"the agent did not reclaim {result.path}: {result.outcome.value} "
            notes.append(
                Announcement(
                    True, EventReason.RECLAIM_NOT_DONE, f"{message}{result.message}".strip()
                )
            )
    return tuple(notes)
