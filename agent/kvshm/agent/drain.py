"""Taking a region off this node: tell its attached workers, wait for them, remove its files.

A drain starts when a region is deleted or no longer placed here. The agent first drops its own
mapping, then publishes a drain event to the workers attached to the region (a notifier, the
kvshm.ipc queue in the region directory), then on every pass probes whether any process still
holds the file. Once none does, or the grace period has passed, it removes the region file and
the files the notifier made, then the directory if nothing else is left in it. A file a live
process holds is never removed before the grace period ends; after it the unlinked memory stays
with its last holder until that process exits.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kvshm.agent.errors import describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.hosting import HostedRegion
from kvshm.agent.printable import printable
from kvshm.agent.saferoot import RegionDir, RegionRoot
from kvshm.agent.sizes import format_bytes
from kvshm.api import OffloadRegion, ReclaimPolicy
from kvshm.region import UnsafePathError
from kvshm.region.naming import region_file_name
from kvshm.region.safefile import check_regular


@dataclass(frozen=True)
class DrainEvent:
    """What attached workers are told: stop using this region before `deadline` (Unix time)."""

    namespace: str
    name: str
    instance_id: str
    reason: str
    deadline: float

    def to_message(self) -> dict[str, Any]:
        return {
            "type": "drain",
            "region": f"{self.namespace}/{self.name}",
            "instanceId": self.instance_id,
            "reason": self.reason,
            "deadline": self.deadline,
        }


class DrainNotifier(Protocol):
    """Delivers drain events to the processes attached to a region (kvshm.agent.notify)."""

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
    file_id: tuple[int, int] | None = None  # the file's (dev, inode), when the agent held it
    notified: bool = False
    message: str = ""


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
            hosted.file_id if hosted is not None else None,
        )

    def advance(self, drain: Drain) -> DrainStep:
        if drain.hosted is not None:
            if drain.hosted.busy:
                return DrainStep(None, "waiting for populating to finish before draining")
            drain.hosted.release()
            drain.hosted = None
        region = drain.region
        file_name = region_file_name(region.instance_id)
        if region.reclaim_policy is ReclaimPolicy.RETAIN:
            path = f"{self._root.path}/{region.key}/{file_name}"
            return DrainStep(
                DrainOutcome.RETAINED,
                f"released by the agent; {path} is kept (reclaimPolicy: Retain) and is "
                f"listed as unclaimed in the node inventory",
            )
        region_dir = self._root.open_region_dir(region.namespace, region.name)
        if region_dir is None:
            return DrainStep(DrainOutcome.GONE, "nothing left to remove")
        with region_dir:
            return self._drain_dir(drain, region_dir, file_name)

    def _drain_dir(self, drain: Drain, region_dir: RegionDir, file_name: str) -> DrainStep:
        region = drain.region
        if not drain.notified:
            self._notifier.publish(
                region_dir,
                DrainEvent(
                    region.namespace,
                    region.name,
                    region.instance_id,
                    drain.reason,
                    drain.deadline_unix,
                ),
            )
            drain.notified = True
        expired = self._clock() >= drain.deadline_monotonic
        leftovers: list[str] = []
        outcome = DrainOutcome.GONE
        note = ""  # what the region's removal could not free
        linked = _extra_links(region_dir, file_name, drain.file_id)
        check = _own_file_check(drain.file_id) if linked else check_regular
        try:
            with self._holds.exclusive(
                region_dir.fd, file_name, region_dir.file_path(file_name), check
            ) as fd:
                if fd is None and not expired:
                    left = max(0.0, drain.deadline_monotonic - self._clock())
                    return DrainStep(
                        None,
                        f"waiting up to {left:.0f}s for the processes holding "
                        f"{region_dir.file_path(file_name)} to detach",
                    )
                outcome = DrainOutcome.RELEASED if fd is not None else DrainOutcome.GRACE_EXPIRED
                # unlinked while the exclusive lock (if any) keeps new attachers out
                problem = region_dir.unlink_regular(
                    file_name, os.fstat(fd) if fd is not None else None, linked_ok=bool(linked)
                )
                if problem:
                    leftovers.append(problem)
                elif linked:
                    note = _still_linked(region_dir, linked)
        except FileNotFoundError:
            pass
        except UnsafePathError as exc:
            leftovers.append(describe(exc))
        self._notifier.close(region_dir)
        for name in self._notifier.file_names(region_dir):
            problem = region_dir.unlink_regular(name)
            if problem:
                leftovers.append(problem)
        return self._finish(region_dir, outcome, leftovers, note)

    def _finish(
        self, region_dir: RegionDir, outcome: DrainOutcome, leftovers: list[str], note: str = ""
    ) -> DrainStep:
        if region_dir.remove_if_empty():
            self._root.remove_namespace_if_empty(region_dir.namespace)
            message = f"removed {region_dir.path}"
        else:
            others = region_dir.entries(limit=6)
            named = ", ".join(map(printable, others[:5])) + (", ..." if len(others) > 5 else "")
            message = (
                f"removed the region's files; {region_dir.path} still holds files the agent "
                f"did not make ({named}) and was left in place"
            )
        if outcome is DrainOutcome.GRACE_EXPIRED:
            message += "; the grace period ended while a process still held the file"
        if note:
            message += "; " + note
        if leftovers:
            message += "; not removed: " + "; ".join(leftovers)
        return DrainStep(outcome, message, leftovers)


def _extra_links(
    region_dir: RegionDir, file_name: str, own: tuple[int, int] | None
) -> os.stat_result | None:
    """The region file's status if it is the agent's own file (the inode it held) and someone
    gave it more names: hard links keep its memory after the region's name is removed."""
    st = region_dir.lstat(file_name)
    if st is None or own is None or not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return None
    return st if (st.st_dev, st.st_ino) == own else None


def _own_file_check(own: tuple[int, int] | None) -> Callable[[os.stat_result, str], None]:
    """Accept the agent's own file whatever its link count (removing a name of it is safe);
    refuse any other inode, and anything not regular."""

    def check(st: os.stat_result, path: str) -> None:
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != own:
            raise UnsafePathError(errno.EAGAIN, f"{path} was replaced meanwhile; left in place")

    return check


def _still_linked(region_dir: RegionDir, st: os.stat_result) -> str:
    """What the extra hard links keep: the message the operator acts on."""
    names = region_dir.names_of((st.st_dev, st.st_ino))
    elsewhere = st.st_nlink - 1 - len(names)
    where = ", ".join(printable(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    parts = [f"{len(names)} in {region_dir.path} ({where})"] if names else []
    if elsewhere > 0:
        parts.append(f"{elsewhere} elsewhere on the filesystem")
    return (
        f"the region file had {st.st_nlink - 1} more hard link(s) ({'; '.join(parts)}), which "
        f"keep {format_bytes(st.st_blocks * 512)} allocated after its removal: remove them "
        f"(find the rest with find {region_dir.path.rsplit('/', 2)[0]} -inum {st.st_ino})"
    )
