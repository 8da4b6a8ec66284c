"""The node-side reconciler: converge the files under the region root to the regions placed here.

Level-based and free of Kubernetes: each pass takes a ClusterView (what a source knows) and
creates, adopts, populates, locks, drains and removes region files until they match it, then
returns every region's NodeReport, the node inventory, reclaim results and the events worth
telling. Slow work (populating, waiting for holders) never blocks a pass: it runs in threads or
is re-checked on the next pass. What leaves the node each pass is kvshm.agent.departures'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from kvshm.agent.counters import Counters, NoCounters
from kvshm.agent.departures import Departures
from kvshm.agent.drain.drainer import Drainer, DrainNotifier
from kvshm.agent.errors import ErrorReason, classify, describe
from kvshm.agent.hosting import HostedRegion, HostingSettings
from kvshm.agent.inventory import InventoryScanner
from kvshm.agent.opening import Refusal, RegionOpener, remove_failed_creation
from kvshm.agent.reclaim import ReclaimBook, Reclaimer
from kvshm.agent.record import Failure, RegionRecord, RegionState
from kvshm.agent.reports import AgentEvent, EventReason, PassResult
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.sizes import format_bytes
from kvshm.agent.tenantfiles import DEFAULT_ALLOWANCE_BYTES, TenantFiles, count_tenant_files
from kvshm.agent.topology import HostTopology
from kvshm.agent.view import ClusterView
from kvshm.agent.warmindex import read_warm_index
from kvshm.api import (
    NodeRegionPhase,
    NodeReport,
    OffloadRegion,
    RegionAddress,
    WarmIndexReport,
)
from kvshm.region import RegionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcilerSettings:
    reserve_bytes: int = 0
    tenant_files_bytes: int = DEFAULT_ALLOWANCE_BYTES  # beside a region and its index
    # whether a root without huge pages is reported as a problem (the OffloadNode's HugePages
    # condition): --huge-pages warn or require
    huge_pages_wanted: bool = True
    drain_grace_seconds: float = 30.0
    retry_seconds: float = 30.0  # first retry after a failed create/populate; doubles
    max_retry_seconds: float = 600.0
    hosting: HostingSettings = field(default_factory=HostingSettings)
    topology: HostTopology | None = None  # None: the host's own, read from sysfs


class NodeReconciler:
    def __init__(
        self,
        root: RegionRoot,
        notifier: DrainNotifier,
        settings: ReconcilerSettings,
        *,
        holds: HoldChecker | None = None,
        counters: Counters | None = None,
        wake: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.settings = settings
        self._holds = holds or HoldChecker()
        self._counters = counters or NoCounters()
        self._wake = wake
        self._clock = clock
        self._notifier = notifier
        self._opener = RegionOpener(
            root,
            self._holds,
            notifier,
            settings.hosting,
            settings.reserve_bytes,
            wake,
            settings.topology,
        )
        self._inventory = InventoryScanner(
            root, self._holds, settings.reserve_bytes, settings.huge_pages_wanted
        )
        self._reclaims = ReclaimBook(Reclaimer(root, self._holds), self._counters)
        self._records: dict[str, RegionRecord] = {}  # key -> everything known of the region
        self._events: list[AgentEvent] = []
        self._departures = Departures(
            self._records,
            Drainer(root, self._holds, notifier, settings.drain_grace_seconds, clock),
            self._counters,
            self._event,
        )

    # -- one pass --------------------------------------------------------------------------

    def reconcile(self, view: ClusterView) -> PassResult:
        self._events = []
        self._holds.refresh()
        desired = view.placed_here()
        given_up = self._forget(view, desired)
        scan = self._inventory.scan(
            lambda address: self._claimant(view, address), view.listed_first
        )
        self._departures.run(view, desired, scan.inventory.files, given_up)
        for key in sorted(desired):
            if key not in view.invalid:
                self._ensure(desired[key])
        reclaims, events = self._reclaims.run(
            view.reclaims, lambda address: self._claimant(view, address)
        )
        self._events.extend(events)
        self._take_in_finished()
        for key in [k for k, r in self._records.items() if r.state is RegionState.ABSENT]:
            del self._records[key]
        busy = any(record.unsettled() for record in self._records.values())
        reports, tenant_files = self._reports(view)
        return PassResult(
            reports=reports,
            tenant_files=tenant_files,
            events=self._events,
            root_scan=scan,
            reclaims=reclaims,
            problems=tuple(view.problems),
            busy=busy,
            settled=not busy,
        )

    def _take_in_finished(self) -> None:
        """Report regions whose opening finished during this pass now, not a pass later."""
        for record in list(self._records.values()):
            hosted = record.hosted
            if hosted is None or not record.finished_opening():
                continue
            if hosted.status().phase is NodeRegionPhase.FAILED:
                self._after_failed_attempt(record)
            else:
                self._note_ready(record)

    def seed_orphaned_since(self, since: dict[str, datetime]) -> None:
        self._inventory.seed_orphaned_since(since)

    def hosted_regions(self) -> dict[str, HostedRegion]:
        return {key: r.hosted for key, r in self._records.items() if r.hosted is not None}

    def records(self) -> dict[str, RegionRecord]:
        """Every region this reconciler holds, drains or still reports, by key (read only)."""
        return dict(self._records)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for every opening thread (tests and --once use it)."""
        for hosted in self.hosted_regions().values():
            hosted.wait(timeout)

    def _record(self, key: str) -> RegionRecord:
        return self._records.setdefault(key, RegionRecord(key))

    # -- claims ----------------------------------------------------------------------------

    def _claimant(self, view: ClusterView, address: RegionAddress) -> str:
        key = address.key
        record = self._records.get(key)
        if record is not None and record.claims(address.instance_id):
            return key
        return view.claimant(address)

    # -- holding ---------------------------------------------------------------------------

    def _ensure(self, region: OffloadRegion) -> None:
        record = self._record(region.key)
        if region.instance_id in record.drains:
            return  # the same file is still being drained: create it afresh afterwards
        record.forget_removed()
        hosted = record.hosted
        if hosted is not None:
            if hosted.busy:
                return
            if hosted.status().phase is NodeRegionPhase.FAILED:
                self._after_failed_attempt(record)
            elif self._keep_hosting(record, hosted, region):
                return
        if record.backing_off(region, self._clock()):
            return
        self._open(record, region)

    def _keep_hosting(
        self, record: RegionRecord, hosted: HostedRegion, region: OffloadRegion
    ) -> bool:
        """Apply spec changes to a ready region; False if it has to be opened again."""
        if region.layout.file_ranges() != hosted.region.layout.file_ranges():
            self._fail(
                record,
                region,
                ErrorReason.SIZE_MISMATCH,
                f"spec asks for {region.layout.describe()}, {region.size_bytes} bytes, but "
                f"{hosted.path} holds {hosted.region.layout.describe()}, "
                f"{hosted.region.size_bytes} bytes; region files are never truncated or "
                f"re-split. Use a new instanceId for the new layout, or delete the region and "
                f"create it again.",
            )
            return True
        if not hosted.still_in_place(self.root):
            record.files_lost().release()
            self._event(
                EventReason.FAILED,
                region,
                f"{hosted.path} was removed, replaced or resized by someone else; opening it again",
            )
            return False
        record.recovered()
        old, hosted.region = hosted.region, region
        if region.access != old.access:
            self._apply_access(record, hosted)
        if region.lock != old.lock:
            hosted.set_lock(region.lock)
        self._note_ready(record)
        return True

    def _apply_access(self, record: RegionRecord, hosted: HostedRegion) -> None:
        region = hosted.region
        try:
            with self.root.ensure_region_dir(region.namespace, region.name, region.access) as d:
                self._notifier.prepare(d, region)  # the event ring's owner and mode too
            hosted.set_access()
        except (RegionError, OSError) as exc:
            message = f"could not apply spec.access: {describe(exc)}"
            self._fail(record, region, classify(exc), message)

    def _open(self, record: RegionRecord, region: OffloadRegion) -> None:
        """Create or adopt the region's file and start populating it."""
        opened = self._opener.open(region, list(self.hosted_regions().values()))
        if isinstance(opened, Refusal):
            self._fail(record, region, opened.reason, opened.message)
            return
        record.opening(opened)
        opened.start()
        verb = "adopted existing" if opened.adopt else "created"
        self._event(
            EventReason.ADOPTED if opened.adopt else EventReason.CREATED,
            region,
            f"{verb} {opened.path} ({format_bytes(region.size_bytes)})",
        )

    def _after_failed_attempt(self, record: RegionRecord) -> None:
        hosted = record.hosted
        assert hosted is not None
        region, status = hosted.region, hosted.status()
        hosted.release()
        message = status.message
        if hosted.created:
            message += remove_failed_creation(self.root, self._holds, hosted)
        reason = status.error or ErrorReason.IO
        record.attempt_failed(self._failure(record, region, reason, message, attempt=True))

    def _fail(
        self, record: RegionRecord, region: OffloadRegion, reason: ErrorReason, message: str
    ) -> None:
        record.failed(self._failure(record, region, reason, message))

    def _failure(
        self,
        record: RegionRecord,
        region: OffloadRegion,
        reason: ErrorReason,
        message: str,
        *,
        attempt: bool = False,
    ) -> Failure:
        """The region's failure, told once per reason and spec; a failed attempt to open or
        populate (attempt) also backs off, a failed check does not."""
        failure = Failure.of(region, reason, message).follows(record.failure)
        if failure.is_news_after(record.failure):
            self._counters.error(reason)
            self._event(EventReason.FAILED, region, failure.message)
            log.warning("region %s failed: %s", region.key, failure.message)
        if attempt:
            settings = self.settings
            failure = failure.after_failed_attempt(
                self._clock(), settings.retry_seconds, settings.max_retry_seconds
            )
        return failure

    def _note_ready(self, record: RegionRecord) -> None:
        hosted = record.hosted
        if hosted is None or record.ready_told:
            return
        record.told_ready()
        status = hosted.status()
        if status.populate_seconds:
            self._counters.populated(status.populate_seconds, hosted.region.size_bytes)
        if status.error is ErrorReason.LOCK:
            self._counters.error(ErrorReason.LOCK)
            self._event(EventReason.LOCK_FAILED, hosted.region, status.message)
        self._event(EventReason.READY, hosted.region, hosted.ready_message())

    # -- reports ---------------------------------------------------------------------------

    def _forget(self, view: ClusterView, desired: dict[str, OffloadRegion]) -> list[OffloadRegion]:
        """Removed reports stay while their region exists (and for one pass after), failures
        while it is wanted. Returns the failed regions given up on (Departures clears them)."""
        given_up = []
        for key, record in self._records.items():
            if key not in view.regions:
                record.forget_removed()
            if record.failure is not None and record.hosted is None and key not in desired:
                given_up.append(record.give_up())
        return given_up

    def _reports(self, view: ClusterView) -> tuple[dict[str, NodeReport], dict[str, TenantFiles]]:
        """Every region's report; and for a Ready one, what its tenant keeps beside it (said in
        its message when it is more than it may)."""
        reports, tenant_files = {}, {}
        for key, record in self._records.items():
            report = record.report(
                self._holds, self._file_path, view.invalid.get(key), self._warm_index
            )
            if report is None:
                continue
            hosted = record.hosted
            if report.phase is NodeRegionPhase.READY and hosted is not None:
                found = self._tenant_files(hosted)
                if found is not None:
                    tenant_files[key] = found
                    if found.over:
                        said = "; ".join(filter(None, [report.message, found.message()]))
                        report = replace(report, message=said)
            reports[key] = report
        return reports, tenant_files

    def _tenant_files(self, hosted: HostedRegion) -> TenantFiles | None:
        """None where the directory cannot be read (the region's own report says why)."""
        region = hosted.region
        try:
            region_dir = self.root.open_region_dir(region.namespace, region.name)
            if region_dir is None:
                return None
            with region_dir:
                return count_tenant_files(
                    region_dir,
                    region,
                    frozenset(hosted.file_ids),
                    self.settings.tenant_files_bytes,
                )
        except OSError as exc:
            log.debug("could not count the files beside region %s: %s", region.key, exc)
            return None

    def _file_path(self, region: OffloadRegion) -> str:
        return region.address.path_under(self.root.path)

    def _warm_index(self, region: OffloadRegion) -> WarmIndexReport:
        return read_warm_index(self.root, region)

    def _event(self, reason: EventReason, region: OffloadRegion, message: str) -> None:
        self._events.append(AgentEvent(reason, message, region.key, region.uid))
