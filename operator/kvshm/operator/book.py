"""Every region as last seen, and the one task that makes the writes the operator owes them.

kopf hands each region event to `observe` + `mark`; the task here decides (regions.plan_region)
and writes, at once or after `progress_write_seconds`, so a handler never waits for the API
server and a region's writes are made one after another. Time-based work (an agent going
silent, a node disappearing, a deletion given up on) is decided again on `tick`s from the
OffloadNode sweep timer: kopf pauses that timer while another replica holds the peering, and
with it everything this task would do unprompted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import kopf

from kvshm.api import REGION_PLURAL, SpecError, parse_offload_region, region_key
from kvshm.api.events import EventReason
from kvshm.operator import metrics
from kvshm.operator.announcements import Announcement
from kvshm.operator.announcements import post as post_event
from kvshm.operator.cluster import ClusterSnapshot
from kvshm.operator.config import OperatorConfig
from kvshm.operator.finalizers import add_ops, remove_ops
from kvshm.operator.kube import ClusterWriter, SpecRefused
from kvshm.operator.nodes import add_retained, retained_entry
from kvshm.operator.regions import RegionPlan, plan_region

logger = logging.getLogger(__name__)

# regions decided and written at once (each waits for its writes, not for the others')
CONCURRENT_REGIONS = 16
EVENT, RESYNC = "region_event", "region_resync"


def _trimmed(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the decisions and Events read of a region; managedFields and the rest are dropped
    (they are most of a stored object, and thousands are kept)."""
    meta = body.get("metadata") or {}
    kept = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")
    metadata = {key: meta[key] for key in kept if key in meta}
    if meta.get("finalizers"):
        metadata["finalizers"] = list(meta["finalizers"])
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": metadata,
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def _log(body: Mapping[str, Any], level: int, message: str) -> None:
    """A line that names its region, as kopf's own lines do (logs.ObjectNamingFormatter)."""
    meta = body["metadata"]
    ref = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    logger.log(level, message, extra={"k8s_ref": ref})


def _newer(candidate: Mapping[str, Any], known: Mapping[str, Any] | None) -> bool:
    """Whether candidate is a later version than known: a write's answer can overtake the
    events before it. etcd's revisions are integers; anything else is taken as newer."""
    if known is None:
        return True
    new = str(candidate["metadata"].get("resourceVersion"))
    old = str(known["metadata"].get("resourceVersion"))
    if new.isdigit() and old.isdigit():
        return int(new) >= int(old)
    return True


class RegionBook:
    def __init__(
        self,
        config: OperatorConfig,
        writer: ClusterWriter,
        cluster: Callable[[], ClusterSnapshot],
        finalizer: str,
        post: Callable[[kopf.Body, Announcement], None] | None = None,
    ) -> None:
        self._config, self._writer, self._cluster = config, writer, cluster
        self._finalizer = finalizer
        self._post = post or post_event
        self._bodies: dict[str, dict[str, Any]] = {}
        self._marked: dict[str, str] = {}  # key -> metric label: decide as soon as possible
        self._due: dict[str, float] = {}  # key -> monotonic time its deferred status is due
        self._progress_written: dict[str, float] = {}  # key -> when a status on the way was
        self._running: set[str] = set()
        self._last_resync = self._last_deletions = time.monotonic()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._runs: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._bodies)

    # -- what kopf tells ----------------------------------------------------------------------

    def observe(self, body: Mapping[str, Any]) -> str:
        """Keep this version of a region (unless a later one is known); its key."""
        trimmed = _trimmed(body)
        meta = trimmed["metadata"]
        key = region_key(str(meta.get("namespace")), str(meta["name"]))
        if _newer(trimmed, self._bodies.get(key)):
            self._bodies[key] = trimmed
        return key

    def forget(self, key: str) -> None:
        self._bodies.pop(key, None)
        self._progress_written.pop(key, None)
        self._marked.pop(key, None)
        self._due.pop(key, None)
        metrics.TOTALS.set_region_phase(key, None)

    def mark(self, key: str, label: str = EVENT) -> None:
        """Decide this region again as soon as possible."""
        self._marked.setdefault(key, label)
        self._start()

    def tick(self) -> None:
        """Time passed (the sweep timer runs): decide what time alone changes, when due."""
        now = time.monotonic()
        if now - self._last_deletions >= self._config.deletion_poll_seconds:
            self._last_deletions = now
            for key, body in self._bodies.items():
                if body["metadata"].get("deletionTimestamp"):
                    self._marked.setdefault(key, RESYNC)
        if now - self._last_resync >= self._config.region_resync_seconds:
            self._last_resync = now
            for key in self._bodies:
                self._marked.setdefault(key, RESYNC)
        self._start()

    # -- the task -----------------------------------------------------------------------------

    def _start(self) -> None:
        """Start the task (from a handler: kopf's Event posting works in its context)."""
        if self._task is None:
            self._wake, self._slots = asyncio.Event(), asyncio.Semaphore(CONCURRENT_REGIONS)
            self._task = asyncio.create_task(self._loop(), name="kvshm-regions")
        assert self._wake is not None
        self._wake.set()

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._runs) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None

    async def _loop(self) -> None:
        assert self._wake is not None and self._slots is not None
        while True:
            now = time.monotonic()
            for key, due in list(self._due.items()):
                if due <= now:
                    self._marked.setdefault(key, EVENT)
            for key in [key for key in self._marked if key not in self._running]:
                label = self._marked.pop(key)
                await self._slots.acquire()
                self._running.add(key)
                run = asyncio.create_task(self._run(key, label))
                self._runs.add(run)
                run.add_done_callback(self._runs.discard)
            self._wake.clear()
            waiting = [due for key, due in self._due.items() if key not in self._running]
            timeout = max(0.0, min(waiting) - time.monotonic()) if waiting else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _run(self, key: str, label: str) -> None:
        assert self._slots is not None and self._wake is not None
        error: BaseException | None = None
        try:
            await self._reconcile(key, label)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc
            logger.exception(f"[{key}] reconcile failed; decided again on its next event")
            self._due.pop(key, None)
        finally:
            metrics.RECONCILES.labels(handler=label, outcome=metrics.outcome(error)).inc()
            self._running.discard(key)
            self._slots.release()
            self._wake.set()

    # -- one region ---------------------------------------------------------------------------

    async def _reconcile(self, key: str, label: str) -> None:
        body = self._bodies.get(key)
        if body is None:
            return
        started = time.perf_counter()
        plan = plan_region(body, self._cluster(), self._finalizer, datetime.now(UTC))
        metrics.RECONCILE_SECONDS.labels(handler=label).observe(time.perf_counter() - started)
        if plan.derived is None:
            self._due.pop(key, None)
            return
        metrics.TOTALS.set_region_phase(key, None if plan.release else plan.derived.phase)
        meta = body["metadata"]
        if plan.add_finalizer:
            ops = add_ops(meta, self._finalizer)
            if ops is not None and not await self._patch(key, body, ops):
                return  # changed meanwhile, or gone: its next event decides again
            _log(body, logging.DEBUG, f"added the finalizer {self._finalizer}")
        if plan.release:
            await self._release(key, body, plan)
            return
        if plan.status is None:
            self._due.pop(key, None)
            return
        due = self._due.get(key)
        if not plan.write_now and (due is None or due > time.monotonic()):
            self._due.setdefault(key, self._progress_due(key))
            return
        self._due.pop(key, None)
        written = await self._writer.patch_region_status(
            str(meta.get("namespace")), str(meta["name"]), plan.status
        )
        if written is not None:
            if plan.write_now:
                self._progress_written.pop(key, None)
            else:
                self._progress_written[key] = time.monotonic()
            self.observe(written)
            self._announce(body, plan.announcements)
            if "phase" in plan.status:
                _log(body, logging.INFO, f"status {plan.status['phase']}: {plan.derived.message}")

    def _progress_due(self, key: str) -> float:
        """When a status on the way may be written: progress_write_seconds from now, and at most
        one such write per region_resync_seconds (agents that take long, or a loaded API server,
        would otherwise cost a write for Pending and another for Provisioning)."""
        soonest = time.monotonic() + self._config.progress_write_seconds
        last = self._progress_written.get(key)
        return soonest if last is None else max(soonest, last + self._config.region_resync_seconds)

    async def _patch(self, key: str, body: Mapping[str, Any], ops: list[dict[str, Any]]) -> bool:
        meta = body["metadata"]
        written = await self._writer.json_patch(
            REGION_PLURAL, str(meta.get("namespace")), str(meta["name"]), ops
        )
        if written is None:
            return False
        self.observe(written)
        return True

    async def _release(self, key: str, body: Mapping[str, Any], plan: RegionPlan) -> None:
        self._due.pop(key, None)
        if plan.retained:
            await self._mark_retained(body, plan.retained)
        ops = remove_ops(body["metadata"], self._finalizer)
        if ops is not None and await self._patch(key, body, ops):
            self._announce(body, plan.announcements)
            assert plan.derived is not None
            _log(body, logging.INFO, f"released: {plan.derived.message}")

    async def _mark_retained(self, body: Mapping[str, Any], nodes: tuple[str, ...]) -> None:
        """Record retained files in their nodes' specs, so orphan reclaim leaves them alone.

        A record that cannot be written (a full list) is lost, with a Warning: the deletion
        goes on, since retrying would hold the finalizer for good."""
        try:
            region = parse_offload_region(body)
        except SpecError:
            return  # an invalid spec names no file
        entry = retained_entry(region.key, region.address.file_0_path, datetime.now(UTC))
        for node in nodes:
            try:
                await self._writer.edit_offload_node_spec(node, add_retained(entry))
            except SpecRefused as exc:
                message = f"released anyway; on node {node}: {exc}"
                self._announce(
                    body, (Announcement(True, EventReason.RETAIN_NOT_RECORDED, message),)
                )

    def _announce(self, body: Mapping[str, Any], notes: tuple[Announcement, ...]) -> None:
        region = kopf.Body(cast(kopf.RawBody, dict(body)))
        for note in notes:
            self._post(region, note)
