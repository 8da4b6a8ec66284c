"""Making a region's pages resident before anyone needs them: parallel MADV_POPULATE_WRITE.

Populating allocates every tmpfs page up front, so a full filesystem is an error here, with
sizes, instead of a SIGBUS later in whichever process first touches the missing page.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

from kvshm.region import memory

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
ProgressCallback = Callable[[int], None]
"""Called with the number of bytes populated so far (from worker threads)."""

# What madvise answers when a page cannot be allocated: tmpfs full (a would-be SIGBUS is
# EFAULT), or memory / cgroup limits (ENOMEM).
_OUT_OF_SPACE = {errno.EFAULT, errno.ENOMEM, errno.ENOSPC}


class PopulateMethod(Enum):
    MADVISE = "madvise"
    """MADV_POPULATE_WRITE: allocates the pages and maps them writable in this process."""
    FALLOCATE = "fallocate"
    """Fallback for kernels without MADV_POPULATE_WRITE: allocates the file's pages (existing
    bytes are kept) and leaves page-table entries to be filled on first touch (minor faults).
    Unlike writing a byte into every page, it cannot race with workers writing their cells."""


class PopulateOutOfSpace(OSError):
    """A page could not be allocated; errno and offset say which."""

    def __init__(self, err: int, offset: int) -> None:
        self.reason = os.strerror(err)
        super().__init__(err, f"{self.reason} at offset {offset}")
        self.offset = offset


# More threads contend on the file's page-cache locks and slow down (docs/benchmarks.md,
# "populate on a huge-page tmpfs").
MAX_DEFAULT_THREADS = 8


def default_threads() -> int:
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))


def split_ranges(
    ranges: Sequence[tuple[int, int]], chunk_bytes: int, boundaries: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """Cut (offset, length) ranges into pieces of at most chunk_bytes, page-aligned inside, that
    never cross one of the boundaries (where one file of the region ends and the next begins)."""
    chunk_bytes = max(memory.PAGE_SIZE, chunk_bytes - chunk_bytes % memory.PAGE_SIZE)
    cuts = sorted(boundaries)
    pieces = []
    for offset, length in ranges:
        end = offset + length
        next_cut = bisect.bisect_right(cuts, offset)
        while offset < end:
            limit = cuts[next_cut] if next_cut < len(cuts) else end
            step = min(chunk_bytes, end - offset, limit - offset)
            pieces.append((offset, step))
            offset += step
            if next_cut < len(cuts) and offset >= cuts[next_cut]:
                next_cut += 1
    return pieces


@dataclass(frozen=True)
class MappedFile:
    """One file of a region: where it sits in the mapping, and its descriptor."""

    offset: int
    length: int
    fd: int


def interleave_by_file(
    pieces: Sequence[tuple[int, int]], files: Sequence[MappedFile], first_file: int = 0
) -> list[tuple[int, int]]:
    """Reorder pieces round-robin over the files they fall in, starting with first_file.
    Page-cache inserts serialise per file, so with at least as many files as threads each thread
    then works in a file of its own; workers populating their cells at once start on different
    files."""
    starts = [file.offset for file in files]
    per_file: list[list[tuple[int, int]]] = [[] for _ in files]
    for piece in pieces:
        per_file[max(0, bisect.bisect_right(starts, piece[0]) - 1)].append(piece)
    start = first_file % len(per_file) if per_file else 0
    ordered: list[tuple[int, int]] = []
    for round_ in itertools.zip_longest(*per_file[start:], *per_file[:start]):
        ordered.extend(piece for piece in round_ if piece is not None)
    return ordered


class Populator:
    """Populates ranges of one mapping (of one or more files) in parallel threads and reports
    progress."""

    def __init__(
        self,
        address: int,
        files: Sequence[MappedFile],
        *,
        threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        method: PopulateMethod = PopulateMethod.MADVISE,
        progress: ProgressCallback | None = None,
        first_file: int = 0,
    ) -> None:
        self._address = address
        self._first_file = first_file
        self._files = sorted(files, key=lambda file: file.offset)
        self._starts = [file.offset for file in self._files]
        self._threads = threads or default_threads()
        self._chunk_bytes = chunk_bytes
        self.method = method
        self._progress = progress
        self._done_bytes = 0
        self._lock = threading.Lock()

    def populate(self, ranges: Sequence[tuple[int, int]]) -> PopulateMethod:
        """Populate every range; return the method that did it.

        Raises PopulateOutOfSpace when the filesystem or memory limits cannot hold the pages.
        """
        pieces = interleave_by_file(
            split_ranges(ranges, self._chunk_bytes, self._starts[1:]), self._files, self._first_file
        )
        if self.method is PopulateMethod.MADVISE:
            try:
                self._run(pieces[:1])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning(
                    "MADV_POPULATE_WRITE refused (kernel older than 5.14?): "
                    "falling back to fallocate"
                )
                self.method = PopulateMethod.FALLOCATE
                self._run(pieces[:1])
            pieces = pieces[1:]
        self._run(pieces)
        return self.method

    def _run(self, pieces: Sequence[tuple[int, int]]) -> None:
        if len(pieces) <= 1 or self._threads == 1:
            for piece in pieces:
                self._one(piece)
            return
        with ThreadPoolExecutor(self._threads, thread_name_prefix="kvshm-populate") as pool:
            # list() re-raises the first worker exception here
            list(pool.map(self._one, pieces))

    def _one(self, piece: tuple[int, int]) -> None:
        offset, length = piece
        try:
            if self.method is PopulateMethod.MADVISE:
                memory.madvise(self._address + offset, length, memory.MADV_POPULATE_WRITE)
            else:
                file = self._files[bisect.bisect_right(self._starts, offset) - 1]
                os.posix_fallocate(file.fd, offset - file.offset, length)
        except OSError as exc:
            if exc.errno in _OUT_OF_SPACE:
                raise PopulateOutOfSpace(exc.errno, offset) from exc
            raise
        if self._progress is not None:
            with self._lock:
                self._done_bytes += length
                done = self._done_bytes
            self._progress(done)
