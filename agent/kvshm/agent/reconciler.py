"""The node-side reconciler: converge the files under the region root to the regions placed here.

Level-based and free of Kubernetes: each pass takes a ClusterView (what a source knows) and
creates, adopts, populates, locks, drains and removes region files until they match it, then
returns every region's NodeReport, the node inventory, reclaim results and the events worth
telling. Slow work (populating, waiting for holders) never blocks a pass: it runs in threads or
is re-checked on the next pass.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from kvshm.agent.capacity import CapacityCheck
from kvshm.agent.counters import Counters, NoCounters
from kvshm.agent.descriptors import DescriptorBudget
from kvshm.agent.drain import Drain, Drainer, DrainNotifier, DrainOutcome
from kvshm.agent.errors import ErrorReason, classify, describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.hosting import HostedRegion, HostingSettings
from kvshm.agent.inventory import InventoryScanner
from kvshm.agent.reclaim import ReclaimBook, Reclaimer
from kvshm.agent.regionfiles import RegionFileSet, files_of, holding_all, unlink_held
from kvshm.agent.reports import AgentEvent, EventReason, PassResult
from kvshm.agent.saferoot import RegionDir, RegionRoot
from kvshm.agent.sizes import format_bytes
from kvshm.agent.view import ClusterView
from kvshm.api import InventoryFile, NodeRegionPhase, NodeReport, OffloadRegion, RegionAddress
from kvshm.region import (
    RegionError,
    RegionExtraFileError,
    RegionFileExistsError,
    RegionFileMissingError,
    RegionSizeMismatchError,
    UnsafePathError,
)
from kvshm.region.naming import region_file_name
from kvshm.region.safefile import check_regular

log = logging.getLogger(__name__)

_HOLDING = (
    NodeRegionPhase.PENDING,
    NodeRegionPhase.CREATING,
    NodeRegionPhase.POPULATING,
    NodeRegionPhase.READY,
)
_FINISHED = (NodeRegionPhase.READY, NodeRegionPhase.FAILED)


@dataclass(frozen=True)
class ReconcilerSettings:
    reserve_bytes: int = 0
    drain_grace_seconds: float = 30.0
    retry_seconds: float = 30.0  # first retry after a failed create/populate; doubles
    max_retry_seconds: float = 600.0
    hosting: HostingSettings = field(default_factory=HostingSettings)


@dataclass
class _Failure:
    region: OffloadRegion
    reason: ErrorReason
    message: str
    retry_at: float = 0.0  # failed attempts to open/populate back off; checks do not
    retry_delay: float = 0.0


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
        self._populate_slots = threading.Semaphore(max(1, settings.hosting.parallel_regions))
        self._descriptors = DescriptorBudget()
        self._drainer = Drainer(root, self._holds, notifier, settings.drain_grace_seconds, clock)
        self._inventory = InventoryScanner(root, self._holds, settings.reserve_bytes)
        self._reclaims = ReclaimBook(Reclaimer(root, self._holds), self._counters)
        self._hosted: dict[str, HostedRegion] = {}
        self._failures: dict[str, _Failure] = {}
        self._drains: dict[tuple[str, str], Drain] = {}  # (key, instance id) -> drain
        self._finished: dict[str, NodeReport] = {}  # key -> Removed report, while still known
        self._reported_ready: set[str] = set()
        self._events: list[AgentEvent] = []
        self._given_up: list[OffloadRegion] = []  # failed, then unwanted: see _report_given_up

    # -- one pass --------------------------------------------------------------------------

    def reconcile(self, view: ClusterView) -> PassResult:
        self._events = []
        self._holds.refresh()
        desired = view.placed_here()
        self._forget(view, desired)
        scan = self._inventory.scan(lambda address: self._claimant(view, address))
        self._release_unwanted(view, desired)
        self._drain_leftovers(view, desired, scan.inventory.files)
        self._report_given_up(view)
        self._advance_drains()
        for key in sorted(desired):
            if key not in view.invalid:
                self._ensure(desired[key])
        reclaims, events = self._reclaims.run(
            view.reclaims, lambda address: self._claimant(view, address)
        )
        self._events.extend(events)
        self._take_in_finished()
        busy = any(self._unsettled(h) for h in self._hosted.values()) or bool(self._drains)
        return PassResult(
            reports=self._reports(view, desired),
            events=self._events,
            root_scan=scan,
            reclaims=reclaims,
            problems=tuple(view.problems),
            busy=busy,
            settled=not busy,
        )

    def _take_in_finished(self) -> None:
        """Report regions whose opening finished during this pass now, not a pass later."""
        for key, hosted in list(self._hosted.items()):
            if hosted.busy or key in self._failures:
                continue
            phase = hosted.status().phase
            if phase is NodeRegionPhase.FAILED:
                self._after_failed_attempt(hosted)
            elif phase is NodeRegionPhase.READY:
                self._note_ready(hosted)

    def _unsettled(self, hosted: HostedRegion) -> bool:
        """Still opening, or finished and not yet taken in by a pass (its Ready or Failed is
        still to be reported)."""
        phase = hosted.status().phase
        if hosted.busy or phase is NodeRegionPhase.FAILED:
            return True
        return phase is NodeRegionPhase.READY and hosted.region.key not in self._reported_ready

    def seed_unclaimed_since(self, since: dict[str, datetime]) -> None:
        self._inventory.seed_unclaimed_since(since)

    def hosted_regions(self) -> dict[str, HostedRegion]:
        return dict(self._hosted)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for every opening thread (tests and --once use it)."""
        for hosted in list(self._hosted.values()):
            hosted.wait(timeout)

    # -- claims ----------------------------------------------------------------------------

    def _claimant(self, view: ClusterView, address: RegionAddress) -> str:
        key = address.key
        hosted = self._hosted.get(key)
        if hosted is not None and hosted.region.instance_id == address.instance_id:
            return key
        if (key, address.instance_id) in self._drains:
            return key
        return view.claimant(address)

    # -- leaving ---------------------------------------------------------------------------

    def _release_unwanted(self, view: ClusterView, desired: dict[str, OffloadRegion]) -> None:
        for key, hosted in list(self._hosted.items()):
            if key in view.invalid:
                continue  # an unreadable spec changes nothing that exists (loses nothing)
            target = desired.get(key)
            if target is not None and target.instance_id == hosted.region.instance_id:
                continue
            del self._hosted[key]
            if target is not None:
                reason = (
                    f"instanceId changed from {hosted.region.instance_id!r} to "
                    f"{target.instance_id!r}"
                )
            elif key in view.regions and not view.regions[key].deleting:
                reason = f"no longer placed on node {view.node_name}"
            else:
                reason = "region deleted"
            self._begin_drain(hosted.region, hosted, reason)

    def _drain_leftovers(
        self, view: ClusterView, desired: dict[str, OffloadRegion], files: tuple[InventoryFile, ...]
    ) -> None:
        """Files of regions that exist but are not placed here (the agent was down when the
        placement changed or the deletion started): drain those too."""
        for file in files:
            key = file.claimed_by
            known = view.regions.get(key)
            if known is None or key in desired or key in self._hosted or key in self._finished:
                continue
            if (key, known.region.instance_id) not in self._drains:
                reason = "region deleted" if known.deleting else "not placed on this node"
                self._begin_drain(known.region, None, reason)

    def _report_given_up(self, view: ClusterView) -> None:
        """A failed region no longer wanted here (deleted, or placed elsewhere) whose file is
        not on the node (the inventory found none to drain) is Removed: its last report,
        Failed, would otherwise hold its deletion forever."""
        for region in self._given_up:
            key = region.key
            if key in view.regions and (key, region.instance_id) not in self._drains:
                self._remove_empty_dir(region)
                self._finished[key] = NodeReport(
                    NodeRegionPhase.REMOVED,
                    message="nothing of the region is on this node",
                    observed_generation=region.generation,
                )
        self._given_up = []

    def _remove_empty_dir(self, region: OffloadRegion) -> None:
        """The directory a failed attempt made, if nothing is in it (anything else stays)."""
        try:
            region_dir = self.root.open_region_dir(region.namespace, region.name)
            if region_dir is None:
                return
            with region_dir:
                if region_dir.remove_if_empty():
                    self.root.remove_namespace_if_empty(region.namespace)
        except (RegionError, OSError) as exc:
            log.warning("kept the directory of failed region %s: %s", region.key, describe(exc))

    def _begin_drain(self, region: OffloadRegion, hosted: HostedRegion | None, why: str) -> None:
        self._drains[(region.key, region.instance_id)] = self._drainer.begin(region, hosted, why)
        self._failures.pop(region.key, None)
        self._reported_ready.discard(region.key)
        self._event(EventReason.DRAINING, region, f"draining: {why}")

    def _advance_drains(self) -> None:
        for drain_key, drain in list(self._drains.items()):
            try:
                step = self._drainer.advance(drain)
            except (RegionError, OSError) as exc:
                drain.message = f"drain failed, retried on the next pass: {describe(exc)}"
                self._counters.error(ErrorReason.DRAIN)
                continue
            drain.message = step.message
            if step.outcome is None:
                continue
            del self._drains[drain_key]
            region = drain.region
            if step.outcome is not DrainOutcome.RETAINED:
                self._counters.drained(step.outcome)
            self._finished[region.key] = NodeReport(
                NodeRegionPhase.REMOVED,
                message=step.message,
                observed_generation=region.generation,
            )
            self._event(EventReason.DRAINED, region, step.message)

    # -- holding ---------------------------------------------------------------------------

    def _ensure(self, region: OffloadRegion) -> None:
        key = region.key
        if (key, region.instance_id) in self._drains:
            return  # the same file is still being drained: create it afresh afterwards
        self._finished.pop(key, None)
        hosted = self._hosted.get(key)
        if hosted is not None:
            if hosted.busy:
                return
            if hosted.status().phase is NodeRegionPhase.FAILED:
                self._after_failed_attempt(hosted)
            elif self._keep_hosting(hosted, region):
                return
        failure = self._failures.get(key)
        if failure is not None and failure.region == region and self._clock() < failure.retry_at:
            return
        self._open(region)

    def _keep_hosting(self, hosted: HostedRegion, region: OffloadRegion) -> bool:
        """Apply spec changes to a ready region; False if it has to be opened again."""
        if region.layout.file_ranges() != hosted.region.layout.file_ranges():
            self._fail(
                region,
                ErrorReason.SIZE_MISMATCH,
                f"spec asks for {region.layout.describe()}, {region.size_bytes} bytes, but "
                f"{hosted.path} holds {hosted.region.layout.describe()}, "
                f"{hosted.region.size_bytes} bytes; region files are never truncated or "
                f"re-split. Use a new instanceId for the new layout, or delete the region and "
                f"create it again.",
            )
            return True
        if not self._still_in_place(hosted):
            hosted.release()
            del self._hosted[hosted.region.key]
            self._reported_ready.discard(region.key)
            self._event(
                EventReason.FAILED,
                region,
                f"{hosted.path} was removed, replaced or resized by someone else; opening it again",
            )
            return False
        self._failures.pop(region.key, None)
        old, hosted.region = hosted.region, region
        if region.access != old.access:
            self._apply_access(hosted)
        if region.lock != old.lock:
            hosted.set_lock(region.lock)
        self._note_ready(hosted)
        return True

    def _still_in_place(self, hosted: HostedRegion) -> bool:
        region = hosted.region
        try:
            region_dir = self.root.open_region_dir(region.namespace, region.name)
            if region_dir is None:
                return False
            with region_dir:
                found = [region_dir.lstat(name) for name in hosted.file_names]
        except OSError:  # unsafe now, or unreadable: opened again, which says why
            return False
        # a file truncated (or grown) under the agent is no longer the Ready region it held
        return len(found) == len(hosted.file_ids) and all(
            st is not None and (st.st_dev, st.st_ino) == file_id and st.st_size == length
            for st, file_id, length in zip(found, hosted.file_ids, hosted.file_lengths, strict=True)
        )

    def _apply_access(self, hosted: HostedRegion) -> None:
        region = hosted.region
        try:
            with self.root.ensure_region_dir(region.namespace, region.name, region.access) as d:
                self._notifier.prepare(d, region)  # the event ring's owner and mode too
            hosted.set_access()
        except (RegionError, OSError) as exc:
            self._fail(region, classify(exc), f"could not apply spec.access: {describe(exc)}")

    def _open(self, region: OffloadRegion) -> None:
        """Create or adopt the region's file and start populating it."""
        refusal = self._descriptors.refusal(region.layout.file_count)
        if refusal is not None:  # degrade: refuse this region, keep every pass running
            self._fail(region, ErrorReason.DESCRIPTORS, refusal)
            return
        if not self._room_before_creating(region):
            return
        try:
            region_dir = self.root.ensure_region_dir(region.namespace, region.name, region.access)
        except (RegionError, OSError) as exc:
            self._fail(region, classify(exc), describe(exc))
            return
        with region_dir:
            try:
                adopt, needed = self._inspect(region, region_dir)
            except (RegionError, OSError) as exc:
                self._fail(region, classify(exc), describe(exc))
                return
            check = self._capacity(needed)
            if not check.fits:
                self._fail(region, ErrorReason.CAPACITY, check.refusal(self.root.path))
                return
            hosted = HostedRegion(
                region,
                region_dir,
                adopt=adopt,
                settings=self.settings.hosting,
                on_done=self._wake,
                slots=self._populate_slots,
            )
            self._notifier.prepare(region_dir, region)
        self._hosted[region.key] = hosted
        hosted.start()
        verb = "adopted existing" if adopt else "created"
        self._event(
            EventReason.ADOPTED if adopt else EventReason.CREATED,
            region,
            f"{verb} {hosted.path} ({format_bytes(region.size_bytes)})",
        )

    def _room_before_creating(self, region: OffloadRegion) -> bool:
        """A region with no directory yet is checked for room before anything is made: one
        refused for capacity leaves nothing on the node (and so has nothing to remove)."""
        try:
            existing = self.root.open_region_dir(region.namespace, region.name)
        except (RegionError, OSError):
            return True  # opening it again below says what is wrong
        if existing is not None:
            existing.close()
            return True  # an existing file may be adopted: checked once inspected
        check = self._capacity(region.size_bytes)
        if not check.fits:
            self._fail(region, ErrorReason.CAPACITY, check.refusal(self.root.path))
        return check.fits

    def _inspect(self, region: OffloadRegion, region_dir: RegionDir) -> tuple[bool, int]:
        """(adopt, bytes still to allocate) for the region's files; raises what forbids it.

        Adopted only when every file the layout names is there with its size and nothing else
        of the instance id is; anything else is reported and left as it is (never truncated).
        Files of the id left without their file 0 can be attached by no one: they are removed
        (unless a process holds them) before the region is created afresh."""
        found, unsafe = files_of(region_dir, region.instance_id)
        for entry in unsafe:  # symlink, FIFO, directory, hard link: refused, untouched
            check_regular(entry.stat, region_dir.file_path(entry.name))
        if found is None:
            return False, region.size_bytes
        if not found.has_file_0:
            self._remove_strays(region_dir, found)
            return False, region.size_bytes
        expected = {file.name: file.length for file in region.layout.files(region.instance_id)}
        for file in found.files:
            path = region_dir.file_path(file.name)
            if file.name not in expected:
                raise RegionExtraFileError(path, file.stat.st_size, len(expected))
            if file.stat.st_size != expected[file.name]:
                raise RegionSizeMismatchError(path, file.stat.st_size, expected[file.name])
        missing = [name for name in expected if name not in found.names]
        if missing:
            raise RegionFileMissingError(region_dir.file_path(missing[0]), expected[missing[0]])
        return True, max(0, region.size_bytes - found.allocated_bytes)

    def _remove_strays(self, region_dir: RegionDir, strays: RegionFileSet) -> None:
        with holding_all(self._holds, region_dir, strays.names) as held:
            if held is None:
                raise RegionFileExistsError(
                    region_dir.file_path(strays.first_name),
                    region_dir.file_path(region_file_name(strays.instance_id)),
                )
            problems = unlink_held(region_dir, held)
        if problems:
            raise UnsafePathError(errno.EPERM, "; ".join(problems))
        log.info("removed %s files left without their file 0", ", ".join(strays.names))

    def _capacity(self, needed: int) -> CapacityCheck:
        _, free = self.root.filesystem_bytes()
        committed = 0
        for hosted in self._hosted.values():
            status = hosted.status()
            if status.phase in _HOLDING:
                committed += max(0, hosted.region.size_bytes - status.populated_bytes)
        return CapacityCheck(needed, free, self.settings.reserve_bytes, committed)

    def _after_failed_attempt(self, hosted: HostedRegion) -> None:
        region, status = hosted.region, hosted.status()
        hosted.release()
        del self._hosted[region.key]
        message = status.message
        if hosted.created:
            message += self._remove_failed_creation(hosted)
        previous = self._failures.get(region.key)
        delay = self.settings.retry_seconds
        if previous is not None and previous.region == region and previous.retry_delay:
            delay = min(self.settings.max_retry_seconds, previous.retry_delay * 2)
        self._fail(region, status.error or ErrorReason.IO, message)
        self._failures[region.key].retry_at = self._clock() + delay
        self._failures[region.key].retry_delay = delay

    def _remove_failed_creation(self, hosted: HostedRegion) -> str:
        """Files this agent just created and could not finish hold no one's data: remove them,
        unless someone attached meanwhile."""
        region = hosted.region
        try:
            region_dir = self.root.open_region_dir(region.namespace, region.name)
        except OSError as exc:
            return f"; could not look at the partial files: {describe(exc)}"
        if region_dir is None:
            return ""
        with region_dir:
            try:
                names = [name for name in hosted.file_names if region_dir.lstat(name) is not None]
                with holding_all(self._holds, region_dir, names) as held:
                    if held is None:
                        return "; the partial files are held by a process and were kept"
                    problems = unlink_held(region_dir, held)
            except UnsafePathError:
                return ""
            except OSError as exc:
                return f"; could not remove the partial files: {describe(exc)}"
        if not names:
            return ""
        if problems:
            return f"; kept partial files: {'; '.join(problems)}"
        return "; the partial files were removed"

    def _fail(self, region: OffloadRegion, reason: ErrorReason, message: str) -> None:
        if reason is ErrorReason.PERMISSION and "capabilit" not in message:
            message += (
                f" (the agent, uid {os.geteuid()}, needs CAP_DAC_OVERRIDE to reach files of "
                f"uid {region.access.uid}, and CAP_CHOWN and CAP_FOWNER to give them owner "
                f"and mode; or run it as that uid)"
            )
        previous = self._failures.get(region.key)
        if previous is None or previous.reason is not reason or previous.region != region:
            self._counters.error(reason)
            self._event(EventReason.FAILED, region, message)
            log.warning("region %s failed: %s", region.key, message)
        failure = _Failure(region, reason, message)
        if previous is not None and previous.region == region:
            failure.retry_at, failure.retry_delay = previous.retry_at, previous.retry_delay
        self._failures[region.key] = failure

    def _note_ready(self, hosted: HostedRegion) -> None:
        key = hosted.region.key
        if key in self._reported_ready:
            return
        self._reported_ready.add(key)
        status = hosted.status()
        if status.populate_seconds:
            self._counters.populated(status.populate_seconds, hosted.region.size_bytes)
        if status.error is ErrorReason.LOCK:
            self._counters.error(ErrorReason.LOCK)
            self._event(EventReason.LOCK_FAILED, hosted.region, status.message)
        self._event(EventReason.READY, hosted.region, _ready_message(hosted))

    # -- reports ---------------------------------------------------------------------------

    def _forget(self, view: ClusterView, desired: dict[str, OffloadRegion]) -> None:
        """Removed reports stay while their region exists (and for one pass after), failures
        while it is wanted."""
        for key in list(self._finished):
            if key not in view.regions:
                del self._finished[key]
        for key in list(self._failures):
            if key not in desired and key not in self._hosted:
                self._given_up.append(self._failures.pop(key).region)

    def _reports(
        self, view: ClusterView, desired: dict[str, OffloadRegion]
    ) -> dict[str, NodeReport]:
        reports = dict(self._finished)
        for (key, _), drain in self._drains.items():
            reports[key] = replace(
                self._plain_report(NodeRegionPhase.DRAINING, drain.region, drain.message),
                holders=self._holds.flock_holders(drain.file_id),
            )
        for key, failure in self._failures.items():
            reports[key] = self._plain_report(
                NodeRegionPhase.FAILED, failure.region, failure.message
            )
        for key, hosted in self._hosted.items():
            if key in self._failures:
                continue
            status = hosted.status()
            phase = status.phase
            if key not in self._reported_ready and phase in _FINISHED:
                phase = NodeRegionPhase.POPULATING  # finished just now: told on the next pass
            message = status.message
            if key in view.invalid:
                message = f"spec refused, the region is kept as it was: {view.invalid[key]}"
            reports[key] = NodeReport(
                phase,
                path=hosted.path,
                size_bytes=hosted.region.size_bytes,
                populated_bytes=status.populated_bytes,
                locked=status.locked,
                populate_seconds=status.populate_seconds,
                holders=self._holds.flock_holders(hosted.file_id),
                message=message,
                files=hosted.region.layout.file_count,
                observed_generation=hosted.region.generation,
            )
        return reports

    def _plain_report(
        self, phase: NodeRegionPhase, region: OffloadRegion, message: str
    ) -> NodeReport:
        return NodeReport(
            phase,
            path=self._file_path(region),
            size_bytes=region.size_bytes,
            message=message,
            files=region.layout.file_count,
            observed_generation=region.generation,
        )

    def _file_path(self, region: OffloadRegion) -> str:
        return region.address.path_under(self.root.path)

    def _event(self, reason: EventReason, region: OffloadRegion, message: str) -> None:
        self._events.append(AgentEvent(reason, message, region.key, region.uid))


def _ready_message(hosted: HostedRegion) -> str:
    status = hosted.status()
    size = hosted.region.size_bytes
    parts = [f"{hosted.path} ready ({format_bytes(size)})"]
    if status.populate_seconds:
        rate = size / status.populate_seconds / 1e9 if status.populate_seconds else 0.0
        parts.append(f"populated in {status.populate_seconds:.2f}s ({rate:.1f} GB/s)")
    parts.append("locked" if status.locked else "not locked")
    return ", ".join(parts)
