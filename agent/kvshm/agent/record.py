"""One record per region the reconciler knows on this node: its state, the files it holds, its
failure and when to retry, the drains of its files and its last Removed report.

A region (namespace/name) has at most one current instance (the instance id its spec names
now), which is opening, ready or failed; drains of earlier instances (or of this one, once it
is no longer wanted) run beside it. The state says what the region's report is: the current
instance's if there is one, else the newest drain's, else the Removed report. Every change of
state is one of RegionRecord's methods; the reconciler decides when, the record what follows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kvshm.agent.drain.drainer import Drain
from kvshm.agent.errors import ErrorReason
from kvshm.agent.hosting import HostedRegion
from kvshm.agent.root.holders import HoldChecker
from kvshm.api import NodeRegionPhase, NodeReport, OffloadRegion, WarmIndexReport


class RegionState(StrEnum):
    ABSENT = "absent"
    """Nothing of the region held, drained or reported: a record about to open the region, or
    to be dropped at the end of the pass."""
    OPENING = "opening"
    """Its files are being created or adopted, populated and locked in a thread of their own,
    or that finished and the reconciler has not taken the outcome in yet."""
    READY = "ready"
    """Held (mapped, locked as asked) and its Ready told."""
    FAILED = "failed"
    """The last attempt or spec change failed. It may still hold the files (a refused spec
    change keeps the Ready region as it was) or be opening them again (a retry)."""
    DRAINING = "draining"
    """No instance is wanted here; the files of one or more instances are being drained."""
    REMOVED = "removed"
    """Nothing of it is left held or draining; Removed is reported while the region exists."""


@dataclass(frozen=True)
class Backoff:
    """When a region whose files could not be opened or populated is tried again: first after
    `first` seconds, then twice as long after each failed attempt, at most `most`."""

    delay: float = 0.0  # 0: no failed attempt yet
    retry_at: float = 0.0  # on the reconciler's clock

    def waiting(self, now: float) -> bool:
        return now < self.retry_at

    def after_failed_attempt(self, now: float, first: float, most: float) -> Backoff:
        delay = min(most, self.delay * 2) if self.delay else first
        return Backoff(delay, now + delay)


@dataclass(frozen=True)
class Failure:
    """What failed for which spec. Checks that fail (capacity, a file of the wrong size) are
    looked at again on every pass; failed attempts to open or populate wait out the backoff."""

    region: OffloadRegion
    reason: ErrorReason
    message: str
    backoff: Backoff = Backoff()

    @classmethod
    def of(cls, region: OffloadRegion, reason: ErrorReason, message: str) -> Failure:
        """The failure, its message saying what to do where the agent lacks a permission."""
        if reason is ErrorReason.PERMISSION and "capabilit" not in message:
            message += (
                f" (the agent, uid {os.geteuid()}, needs CAP_DAC_OVERRIDE to reach files of "
                f"uid {region.access.uid}, and CAP_CHOWN and CAP_FOWNER to give them owner "
                f"and mode; or run it as that uid)"
            )
        return cls(region, reason, message)

    def follows(self, previous: Failure | None) -> Failure:
        """This failure after the region's previous one: a failed check keeps the backoff of
        the same spec, and a new spec starts afresh."""
        if previous is None or previous.region != self.region:
            return self
        return replace(self, backoff=previous.backoff)

    def after_failed_attempt(self, now: float, first: float, most: float) -> Failure:
        """A failed attempt to open or populate: tried again only after the next backoff."""
        return replace(self, backoff=self.backoff.after_failed_attempt(now, first, most))

    def is_news_after(self, previous: Failure | None) -> bool:
        """Told (event, log, counter) once per reason and spec, not on every pass."""
        return (
            previous is None or previous.reason is not self.reason or previous.region != self.region
        )


@dataclass
class RegionRecord:
    key: str
    state: RegionState = RegionState.ABSENT
    hosted: HostedRegion | None = None  # the current instance's files, once opened
    failure: Failure | None = None  # set exactly in FAILED
    ready_told: bool = False  # the hosted region's Ready event went out
    drains: dict[str, Drain] = field(default_factory=dict)  # instance id -> drain, oldest first
    removed: NodeReport | None = None  # the last drain's (or giving up's) Removed report

    # -- the current instance ------------------------------------------------------------

    def opening(self, hosted: HostedRegion) -> None:
        """The region's files are being opened; a failed region stays Failed until it opens."""
        self.hosted = hosted
        self.ready_told = False
        self.state = RegionState.FAILED if self.failure else RegionState.OPENING

    def told_ready(self) -> None:
        self.ready_told = True
        if self.failure is None:
            self.state = RegionState.READY

    def failed(self, failure: Failure) -> None:
        self.failure = failure
        self.state = RegionState.FAILED

    def attempt_failed(self, failure: Failure) -> None:
        """The opening thread failed (its region already released): the record lets go of it."""
        self._let_go()
        self.failed(failure)

    def recovered(self) -> None:
        """The held region matches its spec again (or still does): the failure is over."""
        self.failure = None
        if self.hosted is not None:
            self.state = RegionState.READY if self.ready_told else RegionState.OPENING
        else:
            self.state = self._without_instance()

    def files_lost(self) -> HostedRegion:
        """The held files were removed or replaced behind the agent: it lets go of them (returned,
        to release) and opens the region again."""
        hosted = self._let_go()
        self.state = RegionState.FAILED if self.failure else self._without_instance()
        return hosted

    def give_up(self) -> OffloadRegion:
        """A failed region holding nothing is no longer wanted here: forget the failure."""
        assert self.failure is not None and self.hosted is None
        region, self.failure = self.failure.region, None
        self.state = self._without_instance()
        return region

    def _let_go(self) -> HostedRegion:
        assert self.hosted is not None
        hosted, self.hosted, self.ready_told = self.hosted, None, False
        return hosted

    # -- drains --------------------------------------------------------------------------

    def draining(self, drain: Drain) -> None:
        """The current instance (if any) is handed to the drain; none is left."""
        self.drains[drain.region.instance_id] = drain
        self.hosted, self.failure, self.ready_told = None, None, False
        self.state = RegionState.DRAINING

    def drained(self, instance_id: str, report: NodeReport) -> None:
        del self.drains[instance_id]
        self.note_removed(report)

    def note_removed(self, report: NodeReport) -> None:
        """Nothing of an instance is left: Removed, unless another instance is held or drained."""
        self.removed = report
        if self.state in (RegionState.ABSENT, RegionState.DRAINING) and not self.drains:
            self.state = RegionState.REMOVED

    def forget_removed(self) -> None:
        """The region is wanted again, or gone from the cluster: its Removed report is over."""
        self.removed = None
        if self.state is RegionState.REMOVED:
            self.state = RegionState.ABSENT

    def _without_instance(self) -> RegionState:
        if self.drains:
            return RegionState.DRAINING
        return RegionState.REMOVED if self.removed is not None else RegionState.ABSENT

    # -- questions the reconciler asks ---------------------------------------------------

    def claims(self, instance_id: str) -> bool:
        """Whether this record holds or drains the files of that instance id."""
        held = self.hosted is not None and self.hosted.region.instance_id == instance_id
        return held or instance_id in self.drains

    def backing_off(self, region: OffloadRegion, now: float) -> bool:
        """Whether opening this spec failed and its retry is not due yet (another spec is
        tried at once)."""
        failure = self.failure
        return failure is not None and failure.region == region and failure.backoff.waiting(now)

    def unsettled(self) -> bool:
        """Still opening, or finished and its outcome not yet taken in (its Ready or Failed is
        still to be reported), or a drain still running."""
        if self.drains:
            return True
        if self.hosted is None:
            return False
        phase = self.hosted.status().phase
        if self.hosted.busy or phase is NodeRegionPhase.FAILED:
            return True
        return phase is NodeRegionPhase.READY and not self.ready_told

    def finished_opening(self) -> bool:
        """An opening thread finished whose outcome (Ready or Failed) is to be taken in now."""
        return (
            self.state is RegionState.OPENING
            and self.hosted is not None
            and not self.hosted.busy
            and self.hosted.status().phase in (NodeRegionPhase.READY, NodeRegionPhase.FAILED)
        )

    # -- its report ----------------------------------------------------------------------

    def report(
        self,
        holds: HoldChecker,
        file_path: Callable[[OffloadRegion], str],
        refusal: str | None = None,
        warm_index: Callable[[OffloadRegion], WarmIndexReport | None] = lambda region: None,
    ) -> NodeReport | None:
        """status.nodes.<node> for the region (None: nothing to say). refusal: why the source
        refused the region's current spec (the held region is kept as it was). warm_index: the
        region's warm-restart index, read for a Ready region only (an engine runs on no
        other)."""
        if self.state is RegionState.FAILED:
            assert self.failure is not None
            failure = self.failure
            return _plain_report(NodeRegionPhase.FAILED, failure.region, failure.message, file_path)
        if self.state is RegionState.DRAINING:
            drain = list(self.drains.values())[-1]  # the newest
            report = _plain_report(NodeRegionPhase.DRAINING, drain.region, drain.message, file_path)
            return replace(report, holders=holds.flock_holders(drain.file_id))
        if self.state is RegionState.REMOVED:
            return self.removed
        if self.hosted is None:  # ABSENT
            return None
        hosted, status = self.hosted, self.hosted.status()
        phase = status.phase
        if not self.ready_told and phase in (NodeRegionPhase.READY, NodeRegionPhase.FAILED):
            phase = NodeRegionPhase.POPULATING  # finished just now: told on the next pass
        message = status.message
        if refusal is not None:
            message = f"spec refused, the region is kept as it was: {refusal}"
        return NodeReport(
            phase,
            path=hosted.path,
            size_bytes=hosted.region.size_bytes,
            populated_bytes=status.populated_bytes,
            locked=status.locked,
            populate_seconds=status.populate_seconds,
            holders=holds.flock_holders(hosted.file_id),
            message=message,
            files=hosted.region.layout.file_count,
            observed_generation=hosted.region.generation,
            warm_index=warm_index(hosted.region) if phase is NodeRegionPhase.READY else None,
        )


def _plain_report(
    phase: NodeRegionPhase,
    region: OffloadRegion,
    message: str,
    file_path: Callable[[OffloadRegion], str],
) -> NodeReport:
    return NodeReport(
        phase,
        path=file_path(region),
        size_bytes=region.size_bytes,
        message=message,
        files=region.layout.file_count,
        observed_generation=region.generation,
    )
