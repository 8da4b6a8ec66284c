"""Drain events to the workers attached to a region: a kvshm.ipc MessageQueue per region.

The queue is a ring file named `kvshm_events` in the region's directory, so a serving pod that
mounts the directory at /dev/shm attaches by path (MessageQueue.attach("/dev/shm/kvshm_events"))
and dequeues plain dicts (see docs/agent.md). The agent is its only writer: it creates the ring
when it opens the region, resumes writing after a restart, and enqueues a drain event when the
region leaves the node. It never reads from the ring, so nothing a tenant writes into the file
is ever unpickled by the agent; a broken or busy ring costs the event, never the drain (holder
probe and grace period still decide removal).

The tenant owns the directory, so whatever is at `kvshm_events` may be the tenant's: a 64 GiB
sparse file, a trailer claiming millions of chunks, a FIFO. The agent maps a ring only of the
geometry it chose itself (reader slots for the region's workers, CHUNKS x CHUNK_BYTES): an
existing file is resumed only if it is a regular single-link file of exactly that size whose
trailer names exactly that geometry, checked before anything is mapped (and never populated).
Anything else is replaced: a new ring is made under a fresh name (O_EXCL), sized, owned and
initialised, then renamed over `kvshm_events` (rename replaces the entry, never follows it).
Owner and mode are (re)applied through the ring's own descriptor whenever a region is prepared,
so a changed spec.access reaches the ring too, also after a restart.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Callable
from typing import Protocol

from kvshm.api import OffloadRegion
from kvshm.ipc import IpcError, MessageQueue, RingLayout, ShmRingBuffer, WaitPolicy
from kvshm.region.drain_event import EVENTS_RING, DrainEvent
from kvshm.region.safefile import describe_file_type

log = logging.getLogger(__name__)

CHUNK_BYTES = 4096
CHUNKS = 8
MAX_READERS = 256
ENQUEUE_TIMEOUT_SECONDS = 1.0
# the agent's loop is a busy Python process: never spin holding the GIL
_WAITS = WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.01)


def reader_slots(region: OffloadRegion) -> int:
    """Two per worker: an engine restarting beside the old one still finds slots."""
    return min(MAX_READERS, 2 * region.layout.num_workers)


def ring_layout(region: OffloadRegion) -> RingLayout:
    """The one geometry the agent makes (and so accepts) for this region's ring."""
    return RingLayout(reader_slots(region), CHUNK_BYTES, CHUNKS)


def is_agent_geometry(layout: RingLayout) -> bool:
    """A geometry the agent could have made for some region (when the region is not known)."""
    return (layout.max_chunk_bytes, layout.max_chunks) == (CHUNK_BYTES, CHUNKS)


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
        self._rings: dict[str, ShmRingBuffer] = {}
        self._files: dict[str, tuple[int, int, int]] = {}  # key -> (dev, inode, size) mapped

    def prepare(self, region_dir: RingDirectory, region: OffloadRegion) -> None:
        """Create the region's queue, or take over writing an existing one (agent restart);
        on every call, give the ring the region's owner and mode."""
        try:
            if region.key not in self._queues:
                expected = ring_layout(region)
                ring = self._resume(region_dir, expected.__eq__, expected.total_bytes)
                if ring is None:
                    ring = self._create(region_dir, region, expected)
                self._keep(region_dir.key, ring)
            access = region.access
            self._rings[region.key].file.set_owner_and_mode(access.uid, access.gid, access.mode)
        except (IpcError, OSError, ValueError) as exc:
            log.warning(
                "region %s: no event queue (%s); drains go on without events", region.key, exc
            )

    @staticmethod
    def _resume(
        region_dir: RingDirectory, accept: Callable[[RingLayout], bool], size: int | None
    ) -> ShmRingBuffer | None:
        """The ring at EVENTS_RING if it can be one the agent made: a regular single-link file
        (of `size` bytes, when known) whose trailer `accept`s; None (and why, logged) if not."""
        st = region_dir.lstat(EVENTS_RING)
        if st is None:
            return None
        why = ""
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            why = f"is {describe_file_type(st.st_mode)} with {st.st_nlink} links"
        elif size is not None and st.st_size != size:
            why = f"is {st.st_size} bytes, not the {size} bytes of the agent's ring"
        else:
            try:
                return ShmRingBuffer.attach(
                    f"{region_dir.fd_path}/{EVENTS_RING}", attach_timeout=0.0, accept=accept
                )
            except (IpcError, OSError) as exc:
                why = f"is not the agent's ring ({exc})"
        log.warning("region %s: %s %s; not used", region_dir.key, EVENTS_RING, why)
        return None

    @staticmethod
    def _create(
        region_dir: RingDirectory, region: OffloadRegion, layout: RingLayout
    ) -> ShmRingBuffer:
        """A new ring, complete before it takes the name (replacing what had it)."""
        ring = ShmRingBuffer(
            layout.n_reader,
            layout.max_chunk_bytes,
            layout.max_chunks,
            f"{EVENTS_RING}.new-{secrets.token_hex(6)}",
            directory=region_dir.fd_path,
            create=True,
            file_mode=region.access.mode,
            owner=(region.access.uid, region.access.gid),
        )
        try:
            ring.file.rename(EVENTS_RING)
        except OSError as exc:
            ring.close(unlink=True)
            raise OSError(
                exc.errno, f"cannot put the ring in place of {EVENTS_RING} ({exc.strerror})"
            ) from exc
        return ring

    def _keep(self, key: str, ring: ShmRingBuffer) -> None:
        queue = MessageQueue.writer_of(
            ring, wait_policy=_WAITS, on_dead_reader="evict", remove_on_close=ring.is_creator
        )
        st = ring.file.stat()  # the mapped file itself, whatever its name says by now
        self._files[key] = (st.st_dev, st.st_ino, ring.layout.total_bytes)
        self._queues[key] = queue
        self._rings[key] = ring

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

    def publish(self, region_dir: RingDirectory, event: DrainEvent) -> None:
        key = region_dir.key
        try:
            if key not in self._queues:
                # draining a region this writer never prepared (after a restart): only a ring
                # of the agent's own making is written to; none is made for a leaving region
                ring = self._resume(region_dir, is_agent_geometry, None)
                if ring is None:
                    return
                self._keep(key, ring)
            queue = self._queues[key]
            if not self._intact(region_dir):
                # never touched again (closing writes to it too); the drain goes on without it
                self._forget(key)
                log.warning("region %s: its event ring was truncated or replaced; no event", key)
                return
            queue.enqueue(event.to_message(), timeout=ENQUEUE_TIMEOUT_SECONDS)
        except (IpcError, OSError, ValueError) as exc:
            log.warning("region %s: drain event not delivered (%s)", key, exc)

    def serve_joins(self) -> None:
        """Accept pending joins and leaves on every ring (it writes to each ring, so only to
        one still at full size: a truncated mapping would fault)."""
        for key, ring in list(self._rings.items()):
            try:
                if ring.file.stat().st_size < ring.layout.total_bytes:
                    self._forget(key)
                    log.warning("region %s: its event ring was truncated; no more events", key)
                    continue
                self._queues[key].joined_readers()
            except (IpcError, OSError) as exc:
                log.warning("region %s: serving joins on its event ring: %s", key, exc)

    def _forget(self, key: str) -> MessageQueue | None:
        self._files.pop(key, None)
        self._rings.pop(key, None)
        return self._queues.pop(key, None)

    def close(self, region_dir: RingDirectory) -> None:
        key = region_dir.key
        intact = self._intact(region_dir)
        queue = self._forget(key)
        if queue is not None and intact:  # closing writes to the ring too
            try:
                queue.close()
            except (IpcError, OSError) as exc:
                log.warning("region %s: closing its event queue: %s", key, exc)

    def file_names(self, region_dir: RingDirectory) -> list[str]:
        return [EVENTS_RING]
