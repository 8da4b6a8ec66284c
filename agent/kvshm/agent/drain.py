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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kvshm.agent.errors import describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.hosting import HostedRegion
from kvshm.agent.regionfiles import (
    describe_unsafe,
    files_of,
    holding_all,
    unlink_held,
    unlink_unheld,
)
from kvshm.agent.saferoot import RegionDir, RegionRoot
from kvshm.api import OffloadRegion, ReclaimPolicy
from kvshm.region import UnsafePathError
from kvshm.region.naming import region_file_name


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
    file_id: tuple[int, int] | None = None  # file 0's (dev, inode), when the agent held it
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
        if region.reclaim_policy is ReclaimPolicy.RETAIN:
            path = f"{self._root.path}/{region.key}/{region_file_name(region.instance_id)}"
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
                    region.namespace,
                    region.name,
                    region.instance_id,
                    drain.reason,
                    drain.deadline_unix,
                ),
            )
            drain.notified = True
        expired = self._clock() >= drain.deadline_monotonic
        file_set, unsafe = files_of(region_dir, region.instance_id)
        leftovers = [describe_unsafe(region_dir, entry) for entry in unsafe]
        outcome = DrainOutcome.GONE
        if file_set is not None:
            path = region_dir.file_path(file_set.first_name)
            try:
                # unlinked while the exclusive locks (if any) keep new attachers out
                with holding_all(self._holds, region_dir, file_set.names) as held:
                    if held is None and not expired:
                        left = max(0.0, drain.deadline_monotonic - self._clock())
                        return DrainStep(
                            None,
                            f"waiting up to {left:.0f}s for the processes holding {path} to detach",
                        )
                    if held is None:
                        outcome = DrainOutcome.GRACE_EXPIRED
                        leftovers += unlink_unheld(region_dir, file_set.names)
                    else:
                        outcome = DrainOutcome.RELEASED
                        leftovers += unlink_held(region_dir, held)
            except UnsafePathError as exc:
                leftovers.append(describe(exc))
        self._notifier.close(region_dir)
        for name in self._notifier.file_names(region_dir):
            problem = region_dir.unlink_regular(name)
            if problem:
                leftovers.append(problem)
        return self._finish(region_dir, outcome, leftovers)

    def _finish(
        self, region_dir: RegionDir, outcome: DrainOutcome, leftovers: list[str]
    ) -> DrainStep:
        if region_dir.remove_if_empty():
            self._root.remove_namespace_if_empty(region_dir.namespace)
            message = f"removed {region_dir.path}"
        else:
            others = region_dir.entries()
            message = (
                f"removed the region's files; {region_dir.path} still holds files the agent "
                f"did not make ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}) "
                f"and was left in place"
            )
        if outcome is DrainOutcome.GRACE_EXPIRED:
            message += "; the grace period ended while a process still held the file"
        if leftovers:
            message += "; not removed: " + "; ".join(leftovers)
        return DrainStep(outcome, message, leftovers)
