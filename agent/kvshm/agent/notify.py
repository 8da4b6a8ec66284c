"""Drain events to the workers attached to a region: a kvshm.ipc MessageQueue per region.

The queue is a ring file named `kvshm_events` in the region's directory, so a serving pod that
mounts the directory at /dev/shm attaches by path (MessageQueue.attach("/dev/shm/kvshm_events"))
and dequeues plain dicts (see docs/agent.md). The agent is its only writer: it creates the ring
when it opens the region, resumes writing after a restart, and enqueues a drain event when the
region leaves the node. It never reads from the ring, so nothing a tenant writes into the file
is ever unpickled by the agent; a broken or busy ring costs the event, never the drain (holder
probe and grace period still decide removal).
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from kvshm.agent.drain import DrainEvent
from kvshm.api import OffloadRegion
from kvshm.ipc import IpcError, MessageQueue, RingLayout, WaitPolicy

log = logging.getLogger(__name__)

EVENTS_RING = "kvshm_events"
CHUNK_BYTES = 4096
CHUNKS = 8
MAX_READERS = 256
ENQUEUE_TIMEOUT_SECONDS = 1.0
# the agent's loop is a busy Python process: never spin holding the GIL
_WAITS = WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.01)


def reader_slots(region: OffloadRegion) -> int:
    """Two per worker: an engine restarting beside the old one still finds slots."""
    return min(MAX_READERS, 2 * region.layout.num_workers)


class RingDirectory(Protocol):
    """What the queues need of a region directory: its key and a race-free path to it."""

    @property
    def key(self) -> str: ...

    @property
    def fd_path(self) -> str: ...

    def lstat(self, file_name: str) -> os.stat_result | None: ...


class RegionEventQueues:
    """The agent's writer end of every region's event queue, by region key."""

    def __init__(self) -> None:
        self._queues: dict[str, MessageQueue] = {}
        self._files: dict[str, tuple[int, int, int]] = {}  # key -> (dev, inode, size) mapped

    def prepare(self, region_dir: RingDirectory, region: OffloadRegion) -> None:
        """Create the region's queue, or take over writing an existing one (agent restart)."""
        if region.key in self._queues:
            return
        try:
            if region_dir.lstat(EVENTS_RING) is None:
                queue = MessageQueue(
                    reader_slots(region),
                    CHUNK_BYTES,
                    CHUNKS,
                    name=EVENTS_RING,
                    directory=region_dir.fd_path,
                    file_mode=region.access.mode,
                    owner=(region.access.uid, region.access.gid),
                    wait_policy=_WAITS,
                    on_dead_reader="evict",
                )
            else:
                queue = self._resume(region_dir)
        except (IpcError, OSError, ValueError) as exc:
            log.warning(
                "region %s: no event queue (%s); drains go on without events", region.key, exc
            )
            return
        self._keep(region_dir, queue)

    def _keep(self, region_dir: RingDirectory, queue: MessageQueue) -> None:
        st = region_dir.lstat(EVENTS_RING)
        handle = queue.export_handle()
        size = RingLayout(handle.n_reader, handle.max_chunk_bytes, handle.max_chunks).total_bytes
        if st is not None:
            self._files[region_dir.key] = (st.st_dev, st.st_ino, size)
        self._queues[region_dir.key] = queue

    def _intact(self, region_dir: RingDirectory) -> bool:
        """The tenant owns the ring file: a truncated one would kill the agent with SIGBUS on
        the next write to the mapping. Write only while the file is the one mapped, whole."""
        st = region_dir.lstat(EVENTS_RING)
        expected = self._files.get(region_dir.key)
        return (
            st is not None
            and expected is not None
            and (st.st_dev, st.st_ino) == expected[:2]
            and st.st_size >= expected[2]
        )

    @staticmethod
    def _resume(region_dir: RingDirectory) -> MessageQueue:
        return MessageQueue.resume_writer(
            f"{region_dir.fd_path}/{EVENTS_RING}",
            wait_policy=_WAITS,
            on_dead_reader="evict",
            attach_timeout=ENQUEUE_TIMEOUT_SECONDS,
        )

    def publish(self, region_dir: RingDirectory, event: DrainEvent) -> None:
        key = region_dir.key
        try:
            if key not in self._queues and region_dir.lstat(EVENTS_RING) is not None:
                self._keep(region_dir, self._resume(region_dir))
            queue = self._queues.get(key)
            if queue is None:
                return
            if not self._intact(region_dir):
                # never touched again (closing writes to it too); the drain goes on without it
                self._queues.pop(key)
                log.warning("region %s: its event ring was truncated or replaced; no event", key)
                return
            queue.enqueue(event.to_message(), timeout=ENQUEUE_TIMEOUT_SECONDS)
        except (IpcError, OSError, ValueError) as exc:
            log.warning("region %s: drain event not delivered (%s)", key, exc)

    def close(self, region_dir: RingDirectory) -> None:
        key = region_dir.key
        intact = self._intact(region_dir)
        self._files.pop(key, None)
        queue = self._queues.pop(key, None)
        if queue is not None and intact:  # closing writes to the ring too
            try:
                queue.close()
            except (IpcError, OSError) as exc:
                log.warning("region %s: closing its event queue: %s", key, exc)

    def file_names(self, region_dir: RingDirectory) -> list[str]:
        return [EVENTS_RING]
