"""Taking a region off this node: tell its attached workers, wait for them, remove its files.

A drain starts when a region is deleted or no longer placed here. The agent first drops its own
mapping, then publishes a drain event to the workers attached to the region (a notifier, the
kvshm.ipc queue in the region directory), then on every pass probes whether any process still
holds any of the region's files. Once none does, or the grace period has passed, it removes
every file of the region (file 0 first) and the files the notifier made, then the directory if
nothing else is left in it. A file a live process holds is never removed before the grace
period ends; after it the unlinked memory stays with its last holder until that process exits.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvshm.agent.errors import describe
from kvshm.agent.hosting import HostedRegion
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.regionfiles import (
    FoundFile,
    describe_unsafe,
    files_of,
    holding_all,
    remove_index,
    unlink_held,
    unlink_unheld,
)
from kvshm.agent.root.saferoot import RegionDir, RegionRoot
from kvshm.agent.sizes import format_bytes
from kvshm.api import OffloadRegion, ReclaimPolicy, region_key
from kvshm.api.messages import printable
from kvshm.region import UnsafePathError
from kvshm.region.drain_event import DrainEvent

NOTHING_HERE = "nothing of the region is on this node"


class DrainNotifier(Protocol):
    """Delivers drain events to the processes attached to a region (kvshm.agent.drain.notify)."""

    def prepare(self, region_dir: RegionDir, region: OffloadRegion) -> None:
        """Set up the region's channel when the agent opens the region (workers join it)."""
        ...

    def publish(self, region_dir: RegionDir, event: DrainEvent) -> None: ...

    def close(self, region_dir: RegionDir) -> None:
        """Let go of the region's channel before its files are removed."""
        ...

    def file_names(self, region_dir: RegionDir) -> list[str]:
        """The notifier's own files in the region directory, removed along with the region."""
        ...


class DrainOutcome(StrEnum):
    RELEASED = "released"  # no process held the file any more
    GRACE_EXPIRED = "grace_expired"  # removed although a process still held it
    RETAINED = "retained"  # reclaimPolicy Retain: the agent let go, the file stays
    GONE = "gone"  # nothing was left to remove


@dataclass
class Drain:
    region: OffloadRegion
    reason: str
    deadline_monotonic: float
    deadline_unix: float
    hosted: HostedRegion | None = None
    # every file's (dev, inode), file 0 first, when the agent held the region
    file_ids: tuple[tuple[int, int], ...] = ()
    notified: bool = False
    message: str = ""

    @property
    def file_id(self) -> tuple[int, int] | None:
        """File 0's (dev, inode): the file attachers flock."""
        return self.file_ids[0] if self.file_ids else None


@dataclass(frozen=True)
class DrainStep:
    outcome: DrainOutcome | None  # None: still waiting
    message: str
    leftovers: list[str] = field(default_factory=list)  # what was found and not removed


class Drainer:
    def __init__(
        self,
        root: RegionRoot,
        holds: HoldChecker,
        notifier: DrainNotifier,
        grace_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = root
        self._holds = holds
        self._notifier = notifier
        self._grace = grace_seconds
        self._clock = clock

    def begin(self, region: OffloadRegion, hosted: HostedRegion | None, reason: str) -> Drain:
        return Drain(
            region,
            reason,
            self._clock() + self._grace,
            time.time() + self._grace,
            hosted,
            hosted.file_ids if hosted is not None else (),
        )

    def advance(self, drain: Drain) -> DrainStep:
        if drain.hosted is not None:
            if drain.hosted.busy:
                return DrainStep(None, "waiting for populating to finish before draining")
            drain.hosted.release()
            drain.hosted = None
        region = drain.region
        if region.reclaim_policy is ReclaimPolicy.RETAIN:
            path = region.address.path_under(self._root.path)
            return DrainStep(
                DrainOutcome.RETAINED,
                f"released by the agent; {path} (and any other file of the region) is kept "
                f"(reclaimPolicy: Retain) and is listed as unclaimed in the node inventory",
            )
        region_dir = self._root.open_region_dir(region.namespace, region.name)
        if region_dir is None:
            return DrainStep(DrainOutcome.GONE, "nothing left to remove")
        with region_dir:
            return self._drain_dir(drain, region_dir)

    def _drain_dir(self, drain: Drain, region_dir: RegionDir) -> DrainStep:
        region = drain.region
        if not drain.notified:
            self._notifier.publish(
                region_dir,
                DrainEvent(
                    region_key(region.namespace, region.name),
                    region.instance_id,
                    drain.reason,
                    drain.deadline_unix,
                ),
            )
            drain.notified = True
        expired = self._clock() >= drain.deadline_monotonic
        file_set, unsafe = files_of(region_dir, region.instance_id)
        # the agent's own files that someone gave more names: their names are removed like any
        # other file of the region, and what the extra links keep allocated is reported
        linked = [entry for entry in unsafe if _is_own_linked(entry, drain.file_ids)]
        linked_names = {entry.name for entry in linked}
        leftovers = [
            describe_unsafe(region_dir, entry) for entry in unsafe if entry.name not in linked_names
        ]
        files = sorted([*(file_set.files if file_set else ()), *linked], key=lambda f: f.segment)
        outcome = DrainOutcome.GONE
        notes: list[str] = []  # what the region's removal could not free
        if files:
            names = [file.name for file in files]
            path = region_dir.file_path(names[0])
            checks = {entry.name: _own_file_check(_file_id(entry.stat)) for entry in linked}
            try:
                # unlinked while the exclusive locks (if any) keep new attachers out
                with holding_all(self._holds, region_dir, names, checks) as held:
                    if held is None and not expired:
                        left = max(0.0, drain.deadline_monotonic - self._clock())
                        return DrainStep(
                            None,
                            f"waiting up to {left:.0f}s for the processes holding {path} to detach",
                        )
                    if held is None:
                        outcome = DrainOutcome.GRACE_EXPIRED
                        leftovers += unlink_unheld(region_dir, names, linked_names)
                    else:
                        outcome = DrainOutcome.RELEASED
                        leftovers += unlink_held(region_dir, held, linked_names)
            except UnsafePathError as exc:
                leftovers.append(describe(exc))
            one_file = region.layout.file_count == 1
            notes = [
                _still_linked(region_dir, entry, one_file)
                for entry in linked
                if region_dir.lstat(entry.name) is None  # its name went: the links keep it
            ]
        leftovers += remove_index(region_dir, region.instance_id)
        leftovers += self._remove_event_queue(region_dir)
        return self._finish(region_dir, outcome, leftovers, "; ".join(notes))

    def clear(self, region: OffloadRegion) -> DrainStep | None:
        """What is left of a region no longer wanted here none of whose files is on the node
        (its creation failed, or an earlier agent process removed them): its event queue is
        let go of and removed, then its directory if nothing else is in it. None when a file
        of the region is there after all: drain it instead."""
        try:
            region_dir = self._root.open_region_dir(region.namespace, region.name)
        except UnsafePathError as exc:  # not a directory the agent ever made files in
            return DrainStep(DrainOutcome.GONE, f"{NOTHING_HERE}; {describe(exc)}", [describe(exc)])
        if region_dir is None:
            return DrainStep(DrainOutcome.GONE, NOTHING_HERE)
        with region_dir:
            files, unsafe = files_of(region_dir, region.instance_id)
            if files is not None:
                return None
            leftovers = [describe_unsafe(region_dir, entry) for entry in unsafe]
            leftovers += remove_index(region_dir, region.instance_id)
            leftovers += self._remove_event_queue(region_dir)
            kept = self._remove_dir(region_dir)
            message = f"{NOTHING_HERE}; {kept or f'removed {region_dir.path}'}"
            return DrainStep(DrainOutcome.GONE, _with_leftovers(message, leftovers), leftovers)

    def _remove_event_queue(self, region_dir: RegionDir) -> list[str]:
        """Let go of the region's event queue and remove its files; what was left, and why."""
        self._notifier.close(region_dir)
        leftovers = []
        for name in self._notifier.file_names(region_dir):
            problem = region_dir.unlink_regular(name)
            if problem:
                leftovers.append(problem)
        return leftovers

    def _remove_dir(self, region_dir: RegionDir) -> str | None:
        """Remove the region directory (and the namespace's) if nothing else is in it; None
        if removed, else what it still holds."""
        if region_dir.remove_if_empty():
            self._root.remove_namespace_if_empty(region_dir.namespace)
            return None
        others = region_dir.entries(limit=6)
        named = ", ".join(map(printable, others[:5])) + (", ..." if len(others) > 5 else "")
        return (
            f"{region_dir.path} still holds files the agent did not make ({named}) and was "
            f"left in place"
        )

    def _finish(
        self, region_dir: RegionDir, outcome: DrainOutcome, leftovers: list[str], note: str = ""
    ) -> DrainStep:
        kept = self._remove_dir(region_dir)
        message = (
            f"removed {region_dir.path}" if kept is None else f"removed the region's files; {kept}"
        )
        if outcome is DrainOutcome.GRACE_EXPIRED:
            message += "; the grace period ended while a process still held the file"
        if note:
            message += "; " + note
        return DrainStep(outcome, _with_leftovers(message, leftovers), leftovers)


def _with_leftovers(message: str, leftovers: list[str]) -> str:
    return message + ("; not removed: " + "; ".join(leftovers) if leftovers else "")


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _is_own_linked(entry: FoundFile, own: tuple[tuple[int, int], ...]) -> bool:
    """Whether the entry is one of the agent's own files (an inode it held) that someone gave
    more names: hard links keep its memory after the region's names are removed."""
    st = entry.stat
    return stat.S_ISREG(st.st_mode) and st.st_nlink >= 2 and _file_id(st) in own


def _own_file_check(own: tuple[int, int]) -> Callable[[os.stat_result, str], None]:
    """Accept the agent's own file whatever its link count (removing a name of it is safe);
    refuse any other inode, and anything not regular."""

    def check(st: os.stat_result, path: str) -> None:
        if not stat.S_ISREG(st.st_mode) or _file_id(st) != own:
            raise UnsafePathError(errno.EAGAIN, f"{path} was replaced meanwhile; left in place")

    return check


def _still_linked(region_dir: RegionDir, entry: FoundFile, one_file: bool) -> str:
    """What the extra hard links of one of the region's files keep: the message the operator
    acts on."""
    st = entry.stat
    names = region_dir.names_of(_file_id(st))
    elsewhere = st.st_nlink - 1 - len(names)
    where = ", ".join(printable(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    parts = [f"{len(names)} in {region_dir.path} ({where})"] if names else []
    if elsewhere > 0:
        parts.append(f"{elsewhere} elsewhere on the filesystem")
    what = "the region file" if one_file else f"the region's file {printable(entry.name)}"
    return (
        f"{what} had {st.st_nlink - 1} more hard link(s) ({'; '.join(parts)}), which "
        f"keep {format_bytes(st.st_blocks * 512)} allocated after its removal: remove them "
        f"(find the rest with find {region_dir.path.rsplit('/', 2)[0]} -inum {st.st_ino})"
    )
