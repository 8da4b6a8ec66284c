"""Executing the reclaims the operator writes into this node's OffloadNode spec.

The operator decided from an inventory that may be a minute old, so every condition is checked
again at execution time, under the exclusive flock that keeps new attachers out while the file
is removed: the path must name a region file under the root, no region may claim it, and no
process may hold it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from kvshm.agent.counters import Counters
from kvshm.agent.errors import ErrorReason, describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.reports import AgentEvent, EventReason, ReclaimOutcome, ReclaimResult
from kvshm.agent.saferoot import RegionRoot, is_namespace, is_region_name
from kvshm.region import UnsafePathError, instance_id_from_file_name

ClaimCheck = Callable[[str, str, str], str]
"""(namespace, name, instance id) -> key of the region claiming the file, or ""."""


@dataclass(frozen=True)
class ReclaimRequest:
    path: str  # relative to the root: <namespace>/<name>/vllm_offload_<id>.mmap
    token: str = ""  # the request's content: a changed request is executed again
    size_bytes: int | None = None  # the size the operator decided on; another size is refused


class Reclaimer:
    def __init__(self, root: RegionRoot, holds: HoldChecker) -> None:
        self._root = root
        self._holds = holds

    def execute(self, request: ReclaimRequest, claimed_by: ClaimCheck) -> ReclaimResult:
        def result(outcome: ReclaimOutcome, message: str) -> ReclaimResult:
            return ReclaimResult(request.path, outcome, message, datetime.now(UTC))

        parts = request.path.split("/")
        instance_id = instance_id_from_file_name(parts[-1]) if len(parts) == 3 else None
        if instance_id is None or not is_namespace(parts[0]) or not is_region_name(parts[1]):
            return result(
                ReclaimOutcome.FAILED,
                f"{request.path!r} is not <namespace>/<name>/vllm_offload_<id>.mmap relative to "
                f"the region root; nothing was removed",
            )
        namespace, name, file_name = parts
        claimant = claimed_by(namespace, name, instance_id)
        if claimant:
            return result(
                ReclaimOutcome.REFUSED_CLAIMED, f"region {claimant} claims it; it was kept"
            )
        try:
            region_dir = self._root.open_region_dir(namespace, name)
        except UnsafePathError as exc:
            return result(ReclaimOutcome.FAILED, describe(exc))
        if region_dir is None:
            return result(ReclaimOutcome.DONE, "already gone")
        with region_dir:
            self._holds.refresh()
            path = region_dir.file_path(file_name)
            try:
                with self._holds.exclusive(region_dir.fd, file_name, path) as fd:
                    if fd is None:
                        return result(
                            ReclaimOutcome.REFUSED_HELD,
                            f"a live process holds {path}; it was kept",
                        )
                    locked = os.fstat(fd)
                    if request.size_bytes is not None and locked.st_size != request.size_bytes:
                        return result(
                            ReclaimOutcome.REFUSED_CLAIMED,
                            f"{path} is {locked.st_size} bytes, not the {request.size_bytes} "
                            f"bytes the decision was made on: it was re-created or resized "
                            f"since, so it was kept",
                        )
                    problem = region_dir.unlink_regular(file_name, locked)
            except FileNotFoundError:
                return result(ReclaimOutcome.DONE, "already gone")
            except UnsafePathError as exc:
                return result(ReclaimOutcome.FAILED, describe(exc))
            if problem:
                return result(ReclaimOutcome.FAILED, f"{problem}; nothing was removed")
            if region_dir.remove_if_empty():
                self._root.remove_namespace_if_empty(namespace)
        return result(ReclaimOutcome.DONE, f"removed {path} ({locked.st_blocks * 512} bytes freed)")


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
