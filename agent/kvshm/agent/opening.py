"""Opening a region's files for the agent, and what it finds and leaves in the region's directory
around that: the checks before (descriptors, room on the root), whether existing files are
adopted, stray files of the instance id, the partial files of a failed creation."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshm.agent.drain.drainer import DrainNotifier
from kvshm.agent.errors import ErrorReason, classify, describe
from kvshm.agent.hosting import HostedRegion, HostingSettings
from kvshm.agent.root.capacity import CapacityCheck
from kvshm.agent.root.descriptors import DescriptorBudget
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.regionfiles import RegionFileSet, files_of, holding_all, unlink_held
from kvshm.agent.root.saferoot import RegionDir, RegionRoot
from kvshm.agent.topology import HostTopology, NumaSpecError
from kvshm.agent.topology import choose as choose_numa
from kvshm.api import NodeRegionPhase, OffloadRegion, RootPages
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

# phases in which a held region may still allocate: what it has not yet is committed capacity
_HOLDING = (
    NodeRegionPhase.PENDING,
    NodeRegionPhase.CREATING,
    NodeRegionPhase.POPULATING,
    NodeRegionPhase.READY,
)


@dataclass(frozen=True)
class Refusal:
    """Why a region's files were not opened; checked again on the next pass."""

    reason: ErrorReason
    message: str


class RegionOpener:
    """Creates or adopts a region's files, not yet populating them (HostedRegion.start() does)."""

    def __init__(
        self,
        root: RegionRoot,
        holds: HoldChecker,
        notifier: DrainNotifier,
        hosting: HostingSettings,
        reserve_bytes: int,
        wake: Callable[[], None],
        topology: HostTopology | None = None,
    ) -> None:
        self._root = root
        self._holds = holds
        self._notifier = notifier
        self._hosting = hosting
        self._reserve_bytes = reserve_bytes
        self._wake = wake
        self._topology = topology
        self._populate_slots = threading.Semaphore(max(1, hosting.parallel_regions))
        self._descriptors = DescriptorBudget()

    def open(self, region: OffloadRegion, held: Sequence[HostedRegion]) -> HostedRegion | Refusal:
        """The region's files, or why not; `held`: every other region the agent holds."""
        refusal = self._descriptors.refusal(region.layout.file_count)
        if refusal is not None:  # degrade: refuse this region, keep every pass running
            return Refusal(ErrorReason.DESCRIPTORS, refusal)
        no_room = self._no_room_before_creating(region, held)
        if no_room is not None:
            return no_room
        if self._topology is None:  # read once: the host's NUMA nodes and GPUs do not change
            self._topology = HostTopology.read()
        try:
            numa = choose_numa(region.numa, self._topology)
        except NumaSpecError as exc:
            return Refusal(ErrorReason.SPEC, str(exc))
        try:
            region_dir = self._root.ensure_region_dir(region.namespace, region.name, region.access)
        except (RegionError, OSError) as exc:
            return Refusal(classify(exc), describe(exc))
        with region_dir:
            try:
                adopt, needed = inspect_files(self._holds, region, region_dir, self._root.pages)
            except (RegionError, OSError) as exc:
                return Refusal(classify(exc), describe(exc))
            check = self._capacity(needed, held)
            if not check.fits:
                return Refusal(ErrorReason.CAPACITY, check.refusal(self._root.path))
            hosted = HostedRegion(
                region,
                region_dir,
                adopt=adopt,
                settings=self._hosting,
                on_done=self._wake,
                slots=self._populate_slots,
                numa=numa,
                pages=self._root.pages,
            )
            self._notifier.prepare(region_dir, region)
        return hosted

    def _no_room_before_creating(
        self, region: OffloadRegion, held: Sequence[HostedRegion]
    ) -> Refusal | None:
        """A region with no directory yet is checked for room before anything is made: one
        refused for capacity leaves nothing on the node (and so has nothing to remove)."""
        try:
            existing = self._root.open_region_dir(region.namespace, region.name)
        except (RegionError, OSError):
            return None  # opening it again says what is wrong
        if existing is not None:
            existing.close()
            return None  # an existing file may be adopted: checked once inspected
        check = self._capacity(self._root.pages.allocation_bytes(region.layout), held)
        return None if check.fits else Refusal(ErrorReason.CAPACITY, check.refusal(self._root.path))

    def _capacity(self, needed: int, held: Sequence[HostedRegion]) -> CapacityCheck:
        _, free = self._root.filesystem_bytes()
        committed = 0
        for hosted in held:
            status = hosted.status()
            region = hosted.region
            if status.phase in _HOLDING and status.populated_bytes < region.size_bytes:
                # a root that rounds a file's last huge page up holds more than its size
                allocation = self._root.pages.allocation_bytes(region.layout)
                committed += allocation - status.populated_bytes
        return CapacityCheck(needed, free, self._reserve_bytes, committed)


def inspect_files(
    holds: HoldChecker, region: OffloadRegion, region_dir: RegionDir, pages: RootPages
) -> tuple[bool, int]:
    """(adopt, bytes still to allocate) for the region's files; raises what forbids it.

    Adopted only when every file the layout names is there with its size and nothing else
    of the instance id is; anything else is reported and left as it is (never truncated).
    Files of the id left without their file 0 can be attached by no one: they are removed
    (unless a process holds them) before the region is created afresh."""
    found, unsafe = files_of(region_dir, region.instance_id)
    for entry in unsafe:  # symlink, FIFO, directory, hard link: refused, untouched
        check_regular(entry.stat, region_dir.file_path(entry.name))
    allocation = pages.allocation_bytes(region.layout)
    if found is None:
        return False, allocation
    if not found.has_file_0:
        _remove_strays(holds, region_dir, found)
        return False, allocation
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
    return True, max(0, allocation - found.allocated_bytes)


def _remove_strays(holds: HoldChecker, region_dir: RegionDir, strays: RegionFileSet) -> None:
    with holding_all(holds, region_dir, strays.names) as held:
        if held is None:
            raise RegionFileExistsError(
                region_dir.file_path(strays.first_name),
                region_dir.file_path(region_file_name(strays.instance_id)),
            )
        problems = unlink_held(region_dir, held)
    if problems:
        raise UnsafePathError(errno.EPERM, "; ".join(problems))
    log.info("removed %s files left without their file 0", ", ".join(strays.names))


def remove_failed_creation(root: RegionRoot, holds: HoldChecker, hosted: HostedRegion) -> str:
    """Files this agent just created and could not finish hold no one's data: remove them,
    unless someone attached meanwhile. Returns what to add to the failure's message."""
    region = hosted.region
    try:
        region_dir = root.open_region_dir(region.namespace, region.name)
    except OSError as exc:
        return f"; could not look at the partial files: {describe(exc)}"
    if region_dir is None:
        return ""
    with region_dir:
        try:
            names = [name for name in hosted.file_names if region_dir.lstat(name) is not None]
            with holding_all(holds, region_dir, names) as held:
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
