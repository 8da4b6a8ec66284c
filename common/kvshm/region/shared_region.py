"""SharedOffloadRegion: vLLM's CPU offload region (the files every tensor-parallel worker maps as
one range), created or attached safely, populated in parallel, lockable and registrable with
CUDA."""

from __future__ import annotations

import logging
import mmap
import os
import resource
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvshm.region import memory, safefile
from kvshm.region.errors import (
    InvalidLayoutError,
    RegionError,
    RegionLockError,
    RegionResizedError,
    RegionSpaceError,
)
from kvshm.region.files import DEFAULT_FILE_MODE, OpenMode, RegionFiles, check_file_mode
from kvshm.region.layout import RegionLayout
from kvshm.region.numa import NumaPlacement, set_policy
from kvshm.region.pinning import MAX_REGISTRATION_BYTES, CudaRegistration, cuda_runtime
from kvshm.region.populate import (
    MappedFile,
    PopulateMethod,
    PopulateOutOfSpace,
    Populator,
    ProgressCallback,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
DEFAULT_ATTACH_TIMEOUT_SECONDS = 30.0
DEFAULT_POLL_SECONDS = 0.005


class SharedOffloadRegion:
    """One region, all its files mapped shared and read-write by this process as one range.

    The files are layout.files(instance_id) in `directory`: vllm_offload_<instance_id>.mmap, and
    for a large vllm-0.33 region .mmap.1, .mmap.2, ...; num_blocks rows as the layout's format
    says. That is vLLM's naming, layout and file split, so either side can be kvshm or vLLM.

    A creator creates file 0 first (O_EXCL decides who creates), then every other file with its
    size, and sizes file 0 last: attachers (vLLM's too) wait for file 0 to reach its size, and
    then find every file complete. Files are mapped back to back like vLLM maps them.

    populate=None populates when this process created the region, and when it attached to one
    whose pages are not all allocated yet; with a rank only that worker's cells, else all of it.
    Attached processes hold a shared flock on file 0 so the agent can tell the region is in use;
    hold_every_file (the agent's) holds one on every file for as long as the region is open.

    The files are mapped from a huge-page boundary and the mapping asks for huge pages
    (MADV_HUGEPAGE), so on a tmpfs mounted with huge= every file whose offset is whole huge
    pages gets and maps them. numa: a memory policy set on the files before anything is
    populated (kvshm.region.numa).
    """

    def __init__(
        self,
        instance_id: str,
        layout: RegionLayout,
        rank: int | None = None,
        *,
        directory: str = DEFAULT_DIRECTORY,
        mode: OpenMode | str = OpenMode.CREATE_OR_ATTACH,
        file_mode: int = DEFAULT_FILE_MODE,
        owner: tuple[int, int] | None = None,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
        poll_interval: float = DEFAULT_POLL_SECONDS,
        populate: bool | None = None,
        populate_threads: int | None = None,
        populate_method: PopulateMethod = PopulateMethod.MADVISE,
        progress: ProgressCallback | None = None,
        unlink_on_cleanup: bool | None = None,
        numa: NumaPlacement | None = None,
        hold_every_file: bool = False,
    ) -> None:
        if not isinstance(layout, RegionLayout):
            raise InvalidLayoutError(f"layout must be a RegionLayout, got {layout!r}")
        if rank is not None:
            layout.check_rank(rank)
        self.layout = layout
        self.instance_id = instance_id
        self.rank = rank
        self.files = layout.files(instance_id)
        self.file_name = self.files[0].name
        self.directory = directory
        self.mmap_path = os.path.join(directory, self.file_name)
        self.mode = OpenMode(mode)
        self.file_mode = check_file_mode(file_mode)
        self.populate_method: PopulateMethod | None = None
        self.populate_seconds = 0.0
        self.is_locked = False
        self._populate_threads = populate_threads
        self._populate_method = populate_method
        self._progress = progress
        self._unlink_on_cleanup = unlink_on_cleanup
        self._registration: CudaRegistration | None = None
        self._base: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._memoryviews: list[memoryview] = []
        self._next_view_offset = 0 if rank is None else layout.cell_start(rank)
        self._mapping: mmap.mmap | None = None
        self._offset = 0  # where the region starts in _mapping (a huge-page boundary)
        self._cleaned = False

        started = time.monotonic()
        self._files = RegionFiles(
            instance_id, self.files, directory, self.mode, self.file_mode, owner, hold_every_file
        )
        try:
            self._files.open(layout.size_bytes, attach_timeout, poll_interval)
            self._map()
            if numa is not None:  # before any page is allocated: the file keeps the policy
                set_policy(self.address, layout.size_bytes, numa.nodes, numa.policy)
            self.attach_seconds = time.monotonic() - started
            if populate is None:
                populate = self.is_creator or not self.is_fully_allocated()
            if populate:
                self.populate()
        except BaseException:
            self.cleanup()
            raise

    @property
    def is_creator(self) -> bool:
        """Whether this process created the region's files (O_EXCL on file 0 decided)."""
        return self._files.is_creator

    @property
    def _fds(self) -> list[int]:
        return self._files.fds

    @property
    def _fd(self) -> int:
        return self._files.first_fd

    # -- mapping ---------------------------------------------------------------------------

    def _map(self) -> None:
        """Map every file, back to back, as one range: one file is mapped directly; several
        go into an address range reserved for them, each mapped over its part (MAP_FIXED)."""
        size = self.layout.size_bytes
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        # the files' owner can truncate them at any time, also between sizing and mapping
        self._check_sizes("before it was mapped")
        if len(self.files) == 1:
            try:
                self._mapping = mmap.mmap(self._fd, size, mmap.MAP_SHARED, prot)
            except ValueError:  # Python's mmap refuses a file shorter than the length asked
                self._check_sizes("while it was being mapped")
                raise
            self.address = memory.mapping_address(self._mapping)
        else:
            # the reservation is replaced at once: MAP_NORESERVE keeps it out of the commit
            # charge. One huge page more, so the files start on a huge-page boundary: the
            # kernel gives and maps huge pages only where file offset and address agree
            # (a single file's mapping is placed so by the kernel itself).
            slack = memory.HUGE_PAGE_SIZE if size >= memory.HUGE_PAGE_SIZE else 0
            self._mapping = mmap.mmap(
                -1, size + slack, mmap.MAP_PRIVATE | memory.MAP_NORESERVE, prot
            )
            start = memory.mapping_address(self._mapping)
            self._offset = -start % memory.HUGE_PAGE_SIZE if slack else 0
            self.address = start + self._offset
            for file, fd in zip(self.files, self._fds, strict=True):
                memory.map_file_at(self.address + file.offset, file.length, fd)
        # mmap maps a file that shrank since the check above without a word (the missing pages
        # SIGBUS when touched); cleanup() unmaps the whole range if this refuses it
        self._check_sizes("while it was being mapped")
        # a tmpfs mounted huge=advise gives huge pages only to mappings that ask
        memory.advise_huge_pages(self.address, size)

    def _check_sizes(self, when: str) -> None:
        """Raise RegionResizedError if any file no longer has its layout's length."""
        for index, (file, fd) in enumerate(zip(self.files, self._fds, strict=True)):
            actual = os.fstat(fd).st_size
            if actual != file.length:
                raise RegionResizedError(self._files.path(index), actual, file.length, when)

    def mapped_files(self) -> list[MappedFile]:
        """Each file's place in the mapping and its descriptor (valid until cleanup())."""
        return [
            MappedFile(file.offset, file.length, fd)
            for file, fd in zip(self.files, self._fds, strict=True)
        ]

    def keep_file(self) -> None:
        """Leave the files in place at cleanup, even if this process created them."""
        self._unlink_on_cleanup = False

    def fileno(self) -> int:
        """File 0's descriptor, valid until cleanup()."""
        return self._fd

    def filenos(self) -> list[int]:
        """Every file's descriptor, file 0 first, valid until cleanup()."""
        return list(self._fds)

    # -- memory ----------------------------------------------------------------------------

    def allocated_bytes(self) -> int:
        """Bytes the filesystem holds for the region's files."""
        return self._files.allocated_bytes()

    def is_fully_allocated(self) -> bool:
        """Whether the filesystem holds every page of the files (so no access can SIGBUS)."""
        return self.allocated_bytes() >= self.layout.size_bytes

    def own_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of this process's part of the region: its rank's cells widened to
        pages, or the whole region without a rank."""
        if self.rank is None:
            return [(0, self.layout.size_bytes)]
        return self.layout.rank_ranges(self.rank, memory.PAGE_SIZE)

    def populate(self) -> None:
        """Allocate and map this process's part of the region (own_ranges)."""
        ranges = self.own_ranges()
        populator = Populator(
            self.address,
            self.mapped_files(),
            threads=self._populate_threads,
            method=self._populate_method,
            progress=self._progress,
            # as vLLM does: each worker starts on a different file
            first_file=0
            if self.rank is None
            else self.rank * len(self.files) // self.layout.num_workers,
        )
        started = time.monotonic()
        try:
            self.populate_method = populator.populate(ranges)
        except PopulateOutOfSpace as exc:
            # a page past a file's end faults like a full tmpfs: say which it was
            self._check_sizes("while it was being populated")
            part = "" if self.rank is None else f" worker {self.rank}'s cells"
            raise RegionSpaceError(
                self.mmap_path,
                sum(length for _, length in ranges),
                safefile.free_bytes(self._fd),
                f"{exc.reason} while populating{part} at offset {exc.offset}"
                + ("; the partial file was removed" if self._will_unlink() else ""),
            ) from exc
        self.populate_seconds = time.monotonic() - started

    def _map_pages(self, ranges: list[tuple[int, int]]) -> None:
        Populator(
            self.address,
            self.mapped_files(),
            threads=self._populate_threads,
            method=self._populate_method,
        ).populate(ranges)

    def resident_bytes(self) -> int:
        return memory.resident_bytes(self.address, self.layout.size_bytes)

    def lock(self) -> None:
        """mlock the whole region so its pages are never swapped out."""
        if self.is_locked:
            return
        try:
            memory.mlock(self.address, self.layout.size_bytes)
        except OSError as exc:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            raise RegionLockError(
                exc.errno,
                f"mlock of {self.layout.size_bytes} bytes of {self.mmap_path} was refused "
                f"({exc.strerror}). The process needs the IPC_LOCK capability (in Kubernetes: "
                f"securityContext.capabilities.add: [IPC_LOCK]) or an RLIMIT_MEMLOCK of at "
                f"least the region size (now {limit}).",
            ) from exc
        self.is_locked = True

    def unlock(self) -> None:
        if self.is_locked:
            memory.munlock(self.address, self.layout.size_bytes)
            self.is_locked = False

    # -- CUDA ------------------------------------------------------------------------------

    @property
    def is_pinned(self) -> bool:
        return self._registration is not None

    def pin(
        self, max_chunk_bytes: int = MAX_REGISTRATION_BYTES, *, cells_only: bool = False
    ) -> bool:
        """Register the region with CUDA in row-aligned pieces; warn and return False on failure.

        cells_only: a worker (opened with a rank) registers only its own cells, one piece per
        row, where the layout says that pays (RegionLayout.registers_cells_alone: not for a
        replicated layout, whose every worker uses the whole row); else the whole region.
        """
        if self._registration is not None:
            return True
        cudart, reason = cuda_runtime()
        if cudart is None:
            return self._not_pinned(reason)
        rank = self.rank if cells_only else None
        ranges = self.layout.registration_ranges(rank, memory.PAGE_SIZE, max_chunk_bytes)
        # Map the pages into this process in parallel first: cudaHostRegister faults pages
        # in one thread, and an attacher of an agent-populated region has no page-table
        # entries yet (docs/benchmarks.md, "CUDA registration of 16 GiB").
        try:
            self._map_pages(ranges)
        except OSError as exc:
            return self._not_pinned(exc)
        registration = CudaRegistration(cudart, self.address, ranges)
        try:
            registration.register()
        except OSError as exc:
            return self._not_pinned(exc)
        self._registration = registration
        return True

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the region registered with CUDA by this process (0 when not pinned)."""
        return 0 if self._registration is None else self._registration.registered_bytes

    def _not_pinned(self, reason: object) -> bool:
        log.warning("region %s not pinned: %s; copies will be slower", self.mmap_path, reason)
        return False

    # -- views -----------------------------------------------------------------------------

    def _base_tensor(self) -> torch.Tensor:
        if self._base is None:
            import torch

            assert self._mapping is not None
            self._base = torch.frombuffer(
                self._mapping, dtype=torch.int8, count=self.layout.size_bytes, offset=self._offset
            )
        return self._base

    def create_next_view(self, tensor_page_size: int) -> torch.Tensor:
        """int8 view (num_blocks, tensor_page_size), strides (row_stride, 1), over this worker's
        next tensor_page_size bytes of every cell."""
        if self.rank is None:
            raise RegionError("create_next_view needs a rank: open the region with rank=<worker>")
        if tensor_page_size < 1:
            raise InvalidLayoutError(f"tensor_page_size must be at least 1, got {tensor_page_size}")
        cell_end = self.layout.cell_start(self.rank) + self.layout.cpu_page_size
        end = self._next_view_offset + tensor_page_size
        if end > cell_end:
            raise InvalidLayoutError(
                f"a view of {tensor_page_size} bytes overflows worker {self.rank}'s "
                f"{self.layout.cpu_page_size}-byte cell by {end - cell_end} bytes: the tensors "
                f"of one worker must fit in cpu_page_size"
            )
        view = self._base_tensor().as_strided(
            (self.layout.num_blocks, tensor_page_size),
            (self.layout.row_stride, 1),
            self._next_view_offset,
        )
        self._next_view_offset = end
        self._views.append(view)
        return view

    def create_kv_memoryview(self) -> memoryview:
        """Zero-copy memoryview shaped (num_blocks, row_stride), vLLM's shape. CPython cannot
        take a row of a 2-D memoryview: use view[b, i], numpy.asarray(view)[b] or view.cast("B")."""
        assert self._mapping is not None
        region = memoryview(self._mapping)[self._offset : self._offset + self.layout.size_bytes]
        view = region.cast("B", (self.layout.num_blocks, self.layout.row_stride))
        region.release()  # the cast view keeps the mapping exported; this one need not
        self._memoryviews.append(view)
        return view

    # -- cleanup ---------------------------------------------------------------------------

    def _will_unlink(self) -> bool:
        unlink = self._unlink_on_cleanup
        return self.is_creator if unlink is None else unlink and self.is_creator

    def cleanup(self) -> None:
        """Release everything this process holds; the creator also removes its files. Idempotent."""
        if self._cleaned:
            return
        self._cleaned = True
        if self._registration is not None:
            self._registration.unregister()
            self._registration = None
        self._views.clear()
        self._base = None
        for view in self._memoryviews:
            try:
                view.release()
            except BufferError as exc:  # someone still holds a buffer made from it
                log.warning("memoryview of %s still in use: %s", self.mmap_path, exc)
        self._memoryviews.clear()
        if self._mapping is not None:
            try:
                self.unlock()
            except OSError as exc:
                log.warning("munlock of %s failed: %s", self.mmap_path, exc)
            try:
                self._mapping.close()
            except (BufferError, OSError) as exc:
                log.warning("could not unmap %s (views still in use?): %s", self.mmap_path, exc)
            self._mapping = None
        self._files.close(unlink=self._will_unlink())

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return (
            f"SharedOffloadRegion({self.mmap_path!r}, {self.layout}, rank={self.rank}, "
            f"creator={self.is_creator})"
        )


def pin_mmap_region(region: SharedOffloadRegion, **kwargs: Any) -> bool:
    """Register the region with CUDA; vLLM's name for SharedOffloadRegion.pin()."""
    return region.pin(**kwargs)
