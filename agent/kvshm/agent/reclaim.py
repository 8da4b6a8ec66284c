"""Executing the reclaims the operator writes into this node's OffloadNode spec.

The operator decided from an inventory that may be a minute old, so every condition is checked
again at execution time, under the exclusive flocks that keep new attachers out while the files
are removed: the path must name a region file under the root, no region may claim its instance
id, and no process may hold any of its files. A reclaim removes every file of the region.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from kvshm.agent.counters import Counters
from kvshm.agent.errors import ErrorReason, describe
from kvshm.agent.reports import AgentEvent, EventReason
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.regionfiles import (
    describe_unsafe,
    files_of,
    holding_all,
    remove_index,
    unlink_held,
)
from kvshm.agent.root.saferoot import RegionDir, RegionRoot
from kvshm.api import ReclaimOutcome, ReclaimRequest, ReclaimResult, RegionAddress
from kvshm.region import UnsafePathError

ClaimCheck = Callable[[RegionAddress], str]
"""A region file's address -> key of the region claiming the file, or ""."""


class Reclaimer:
    def __init__(self, root: RegionRoot, holds: HoldChecker) -> None:
        self._root = root
        self._holds = holds

    def execute(self, request: ReclaimRequest, claimed_by: ClaimCheck) -> ReclaimResult:
        def result(outcome: ReclaimOutcome, message: str) -> ReclaimResult:
            return ReclaimResult(request.path, outcome, message, datetime.now(UTC))

        parsed = RegionAddress.from_relative_path(request.path)
        if parsed is None:
            return result(
                ReclaimOutcome.FAILED,
                f"{request.path!r} is not <namespace>/<name>/vllm_offload_<id>.mmap[.<i>] "
                f"relative to the region root; nothing was removed",
            )
        address, _ = parsed
        claimant = claimed_by(address)
        if claimant:
            return result(
                ReclaimOutcome.REFUSED_CLAIMED, f"region {claimant} claims it; it was kept"
            )
        try:
            region_dir = self._root.open_region_dir(address.namespace, address.name)
        except UnsafePathError as exc:
            return result(ReclaimOutcome.FAILED, describe(exc))
        if region_dir is None:
            return result(ReclaimOutcome.DONE, "already gone")
        with region_dir:
            return self._remove(request, region_dir, address.instance_id, result)

    def _remove(
        self,
        request: ReclaimRequest,
        region_dir: RegionDir,
        instance_id: str,
        result: Callable[[ReclaimOutcome, str], ReclaimResult],
    ) -> ReclaimResult:
        """Remove every file of the instance id in the directory, all held exclusively."""
        self._holds.refresh()
        file_set, unsafe = files_of(region_dir, instance_id)
        if unsafe:
            found = "; ".join(describe_unsafe(region_dir, entry) for entry in unsafe)
            return result(ReclaimOutcome.FAILED, f"{found}; nothing was removed")
        if file_set is None:
            return result(ReclaimOutcome.DONE, "already gone")
        path = region_dir.file_path(file_set.first_name)
        try:
            with holding_all(self._holds, region_dir, file_set.names) as held:
                if held is None:
                    return result(
                        ReclaimOutcome.REFUSED_HELD,
                        f"a live process holds {path} (or another file of it); it was kept",
                    )
                locked = [os.fstat(fd) for fd in held.values()]
                size = sum(st.st_size for st in locked)
                if request.size_bytes is not None and size != request.size_bytes:
                    return result(
                        ReclaimOutcome.REFUSED_CLAIMED,
                        f"{path} and its other files are {size} bytes, not the "
                        f"{request.size_bytes} bytes the decision was made on: they were "
                        f"re-created or resized since, so they were kept",
                    )
                problems = unlink_held(region_dir, held)
            problems += remove_index(region_dir, instance_id)  # gone with the region it indexed
        except UnsafePathError as exc:
            return result(ReclaimOutcome.FAILED, describe(exc))
        freed = sum(st.st_blocks * 512 for st in locked)
        if problems:
            return result(ReclaimOutcome.FAILED, "; ".join(problems) + "; not all was removed")
        if region_dir.remove_if_empty():
            self._root.remove_namespace_if_empty(region_dir.namespace)
        files = f"{len(locked)} files" if len(locked) > 1 else "1 file"
        return result(ReclaimOutcome.DONE, f"removed {path} ({files}, {freed} bytes freed)")


class ReclaimBook:
    """Runs each request once and keeps its result while the request stays in the spec; a
    request written again with other content (a new requestedAt) runs again."""

    def __init__(self, reclaimer: Reclaimer, counters: Counters) -> None:
        self._reclaimer = reclaimer
        self._counters = counters
        self._done: dict[str, tuple[str, ReclaimResult]] = {}  # path -> (token, result)

    def run(
        self, requests: Sequence[ReclaimRequest], claimed_by: ClaimCheck
    ) -> tuple[dict[str, ReclaimResult], list[AgentEvent]]:
        wanted = {request.path: request for request in requests}
        for path in list(self._done):
            if path not in wanted:
                del self._done[path]
        events = []
        for path, request in sorted(wanted.items()):
            done = self._done.get(path)
            if done is None or done[0] != request.token:
                result = self._execute(request, claimed_by)
                self._done[path] = (request.token, result)
                events.append(_event(result))
        return {path: result for path, (_, result) in self._done.items()}, events

    def _execute(self, request: ReclaimRequest, claimed_by: ClaimCheck) -> ReclaimResult:
        try:
            result = self._reclaimer.execute(request, claimed_by)
        except OSError as exc:
            result = ReclaimResult(
                request.path, ReclaimOutcome.FAILED, describe(exc), datetime.now(UTC)
            )
        self._counters.reclaimed(result.outcome)
        if result.outcome is ReclaimOutcome.FAILED:
            self._counters.error(ErrorReason.RECLAIM)
        return result


def _event(result: ReclaimResult) -> AgentEvent:
    done = result.outcome is ReclaimOutcome.DONE
    return AgentEvent(
        EventReason.RECLAIMED if done else EventReason.RECLAIM_REFUSED,
        f"{result.path}: {result.outcome.value}: {result.message}",
    )
