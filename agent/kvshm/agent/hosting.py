"""One region the agent holds (all its files): created or adopted, populated, mlocked, kept mapped.

Opening and populating run in a thread of the region's own (populating itself fans out to
more threads), so one large region never delays another's report. The agent keeps the mapping
(and the mlock) for as long as it runs, and a shared flock on every file of the region from the
moment it is made or opened: a process that removes region files no one holds with a shared
flock (vLLM's proposed start-up sweep of orphaned /dev/shm files) leaves a populated region that
no engine holds yet alone. The agent lets go (release) before it probes for holders to remove a
region, and its own pid is left out of the lock table's holder count. Stopping the agent
releases nothing on disk: the files outlive it and are adopted again, never re-created, on the
next start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvshm.agent.errors import ErrorReason, classify, describe
from kvshm.agent.root.rootpages import describe_pages, is_huge
from kvshm.agent.root.saferoot import RegionDir, RegionRoot, set_owner_and_mode
from kvshm.agent.sizes import format_bytes
from kvshm.agent.throttle import RateLimit
from kvshm.agent.topology import NumaChoice
from kvshm.api import NodeRegionPhase, OffloadRegion, RootPages
from kvshm.region import OpenMode, RegionError, RegionLockError, SharedOffloadRegion, memory
from kvshm.region.numa import placement as numa_placement

log = logging.getLogger(__name__)

# The file exists with its size when the agent decides to adopt it; a short wait only covers
# it disappearing in between (then the next pass looks again).
ATTACH_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class HostingSettings:
    populate_threads: int | None = None  # None: one per CPU (at most 8)
    populate_bytes_per_second: float | None = None  # None: as fast as the machine goes
    # Regions opened and populated at once. Populating is memory-bandwidth bound: one region
    # at a time on all threads is as fast overall, and each region is Ready sooner.
    parallel_regions: int = 1


@dataclass(frozen=True)
class HostingStatus:
    phase: NodeRegionPhase  # CREATING, POPULATING, READY or FAILED
    populated_bytes: int = 0
    locked: bool = False
    populate_seconds: float | None = None
    message: str = ""
    error: ErrorReason | None = None


class HostedRegion:
    """The agent's hold on one region file. start() opens it in the background."""

    def __init__(
        self,
        region: OffloadRegion,
        region_dir: RegionDir,
        *,
        adopt: bool,
        settings: HostingSettings,
        on_done: Callable[[], None] = lambda: None,
        slots: threading.Semaphore | None = None,
        numa: NumaChoice | None = None,
        pages: RootPages | None = None,
    ) -> None:
        self.region = region
        self.adopt = adopt
        self.numa = numa or NumaChoice(None, "")
        self._pages = pages
        # after populating: bytes of the agent's mapping on huge pages, and on each NUMA node
        self.huge_bytes: int | None = None
        self.bytes_on_nodes: dict[int, int] = {}
        self.file_name = region.address.file_0_name
        self.path = region_dir.file_path(file_name=self.file_name)
        files = region.layout.files(region.instance_id)
        self.file_names = [file.name for file in files]
        self.file_lengths = [file.length for file in files]  # what each file's size must stay
        # (dev, inode) of every file once opened, file 0 first
        self.file_ids: tuple[tuple[int, int], ...] = ()
        self.created = False  # this attempt made the file (so a failure may remove it)
        self.lock_seconds = 0.0
        self._display_dir = region_dir.path
        self._dir_fd = os.dup(region_dir.fd)
        self._fd_dir = f"/proc/self/fd/{self._dir_fd}"
        self._settings = settings
        self._on_done = on_done
        self._rate = (
            RateLimit(settings.populate_bytes_per_second)
            if settings.populate_bytes_per_second
            else None
        )
        self._shared: SharedOffloadRegion | None = None
        self._state_lock = threading.Lock()
        self._slots = slots or threading.Semaphore(1)
        self._status = HostingStatus(
            NodeRegionPhase.PENDING, message="waiting for other regions to finish populating"
        )
        self._thread = threading.Thread(
            target=self._open, name=f"kvshm-host-{region.key}", daemon=True
        )

    # -- lifecycle (called from the reconciler's thread) -----------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def status(self) -> HostingStatus:
        with self._state_lock:
            return self._status

    def set_lock(self, lock: bool) -> None:
        """Apply a changed spec.lock to a ready region."""
        if self.busy or self._shared is None or self._shared.is_locked == lock:
            return
        message = ""
        if lock:
            message = self._try_lock(self._shared)
        else:
            self._shared.unlock()
        with self._state_lock:
            self._status = HostingStatus(
                self._status.phase,
                self._status.populated_bytes,
                self._shared.is_locked,
                self._status.populate_seconds,
                message,
                ErrorReason.LOCK if message else None,
            )

    @property
    def file_id(self) -> tuple[int, int] | None:
        """File 0's (dev, inode): the file attachers flock."""
        return self.file_ids[0] if self.file_ids else None

    def set_access(self) -> None:
        """Re-apply the region's owner and mode to the open files (spec.access changed)."""
        if not self.busy and self._shared is not None:
            access = self.region.access
            for fd in self._shared.filenos():
                set_owner_and_mode(fd, access.uid, access.gid, access.mode)

    def still_in_place(self, root: RegionRoot) -> bool:
        """Whether every file held is still there under its name, the same inode, its size."""
        region = self.region
        try:
            region_dir = root.open_region_dir(region.namespace, region.name)
            if region_dir is None:
                return False
            with region_dir:
                found = [region_dir.lstat(name) for name in self.file_names]
        except OSError:  # unsafe now, or unreadable: opened again, which says why
            return False
        # a file truncated (or grown) under the agent is no longer the Ready region it held
        return len(found) == len(self.file_ids) and all(
            st is not None and (st.st_dev, st.st_ino) == file_id and st.st_size == length
            for st, file_id, length in zip(found, self.file_ids, self.file_lengths, strict=True)
        )

    def ready_message(self) -> str:
        """The Ready event's message: where, how large, how fast it was populated, locked."""
        status = self.status()
        size = self.region.size_bytes
        parts = [f"{self.path} ready ({format_bytes(size)})"]
        if status.populate_seconds:
            rate = size / status.populate_seconds / 1e9
            parts.append(f"populated in {status.populate_seconds:.2f}s ({rate:.1f} GB/s)")
        if self.huge_bytes is not None and self._pages is not None:
            parts.append(self._huge_pages_message(self.huge_bytes, self._pages))
        if self.numa.placement is not None:
            on = ", ".join(
                f"{format_bytes(b)} on node {n}" for n, b in sorted(self.bytes_on_nodes.items())
            )
            parts.append(f"placed on {self.numa.placement.describe()}, {self.numa.reason}: {on}")
        parts.append("locked" if status.locked else "not locked")
        return ", ".join(parts)

    def _huge_pages_message(self, huge_bytes: int, pages: RootPages) -> str:
        """How much of the region the agent maps with huge pages, and what the layout leaves
        out: vLLM splits the files, so only numBlocks makes every file whole huge pages."""
        layout = self.region.layout
        message = f"{format_bytes(huge_bytes)} on {describe_pages(pages)}"
        small = layout.size_bytes - layout.whole_huge_page_bytes(pages.size_bytes)
        if small:
            message += (
                f" ({format_bytes(small)} can only have small pages: the files are not whole "
                f"{format_bytes(pages.size_bytes)} pages; kvshm layout --huge-pages gives a "
                f"numBlocks whose files are)"
            )
        return message

    def release(self) -> None:
        """Unlock and unmap; the file stays where it is. Only once the thread has finished."""
        if self.busy:
            raise RuntimeError(f"{self.path} is still being opened; wait() first")
        if self._shared is not None:
            self._shared.cleanup()
            self._shared = None

    # -- the opening thread ---------------------------------------------------------------

    def _open(self) -> None:
        try:
            with self._slots:
                # an adopted file exists already: what is left is populating (or nothing)
                self._set(
                    HostingStatus(
                        NodeRegionPhase.POPULATING if self.adopt else NodeRegionPhase.CREATING
                    )
                )
                self._shared = self._open_shared()
                self._finish(self._shared)
        except (RegionError, OSError) as exc:
            self._failed(describe(exc), classify(exc))
        except Exception as exc:
            # anything else is a failed attempt too: a thread that died would leave the region
            # Creating forever, and its half-made files to no one
            log.exception("opening region %s failed unexpectedly", self.region.key)
            self._failed(f"unexpected {type(exc).__name__}: {exc}", ErrorReason.IO)
        finally:
            os.close(self._dir_fd)
            self._dir_fd = -1
            self._on_done()

    def _failed(self, message: str, error: ErrorReason) -> None:
        message = message.replace(self._fd_dir, self._display_dir)
        placement = self.numa.placement
        if error is ErrorReason.POPULATE and placement is not None:
            message += f" (its pages go to {placement.describe()}: {self.numa.reason})"
        self._set(HostingStatus(NodeRegionPhase.FAILED, message=message, error=error))

    def _open_shared(self) -> SharedOffloadRegion:
        region = self.region
        if self.adopt:
            mode, populate = OpenMode.ATTACH, None if region.populate else False
        else:
            mode, populate = OpenMode.CREATE, region.populate
            self.created = True  # O_EXCL decides; FileExistsError below undoes this
        if self._rate is not None:
            self._rate.start()
        try:
            return SharedOffloadRegion(
                region.instance_id,
                region.layout,
                directory=self._fd_dir,
                mode=mode,
                file_mode=region.access.mode,
                owner=(region.access.uid, region.access.gid),
                attach_timeout=ATTACH_TIMEOUT_SECONDS,
                populate=populate,
                populate_threads=self._settings.populate_threads,
                progress=self._progress,
                unlink_on_cleanup=False,
                numa=self.numa.placement,
                hold_every_file=True,
            )
        except FileExistsError:
            self.created = False
            raise

    def _progress(self, done: int) -> None:
        with self._state_lock:
            self._status = HostingStatus(NodeRegionPhase.POPULATING, populated_bytes=done)
        if self._rate is not None:
            self._rate.pace(done)

    def _finish(self, shared: SharedOffloadRegion) -> None:
        access = self.region.access
        ids = []
        for fd in shared.filenos():
            set_owner_and_mode(fd, access.uid, access.gid, access.mode)
            st = os.fstat(fd)
            ids.append((st.st_dev, st.st_ino))
        self.file_ids = tuple(ids)
        size = shared.layout.size_bytes
        populated = size if shared.populate_method else min(size, shared.allocated_bytes())
        if self._pages is not None and is_huge(self._pages):
            self.huge_bytes = memory.huge_mapped_bytes(shared.address, size)
        if self.numa.placement is not None:
            self.bytes_on_nodes = numa_placement(shared.address, size)[1]
        message = self._try_lock(shared) if self.region.lock else ""
        self._set(
            HostingStatus(
                NodeRegionPhase.READY,
                populated_bytes=populated,
                locked=shared.is_locked,
                populate_seconds=shared.populate_seconds if shared.populate_method else None,
                message=message,
                error=ErrorReason.LOCK if message else None,
            )
        )

    def _try_lock(self, shared: SharedOffloadRegion) -> str:
        started = time.monotonic()
        try:
            shared.lock()
        except RegionLockError as exc:
            return f"ready but not locked: {describe(exc)}".replace(self._fd_dir, self._display_dir)
        self.lock_seconds = time.monotonic() - started
        return ""

    def _set(self, status: HostingStatus) -> None:
        with self._state_lock:
            self._status = status
