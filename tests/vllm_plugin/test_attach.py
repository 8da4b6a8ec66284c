"""kvshm.vllm.attach_region on real tmpfs files: a sparse region gets the worker's cells
allocated before vLLM stores into them, a file changed under the attach is told as such, and a
mismatch says what the directory holds."""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvshm.region import RegionLayout, RegionResizedError, memory
from kvshm.region.files import RegionFiles
from kvshm.vllm.attach import RegionCellsOutOfSpace, RegionGeometryMismatch, attach_region
from kvshm.vllm.geometry import RegionGeometry
from tests.huge_pages import assert_mapped_huge
from tests.vllm_plugin.regions import agent_region

MIB = 1 << 20
CELL = 64 * 1024
# 2 workers x 64 KiB cells x 128 rows = 16 MiB: each worker's cells are 8 MiB
TWO_WORKERS = RegionGeometry(128, 2 * CELL, CELL, 2, False)


def fill(directory: Path) -> None:
    """Another writer takes every free byte of the tmpfs."""
    with open(directory / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\1" * MIB)
                filler.flush()
        except OSError:
            pass
    assert os.statvfs(directory).f_bavail == 0


def store_in_child(address: int, offsets: list[int]) -> str:
    """Write a byte at each offset of the mapping in a forked child, as vLLM's first stores
    would; how the child ended."""
    pid = os.fork()
    if pid == 0:
        for offset in offsets:
            ctypes.memset(address + offset, 1, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_sparse_region_gets_this_workers_cells_allocated_and_no_more(
    small_tmpfs: Path,
) -> None:
    """populate: false leaves the agent's region sparse; once attached, worker 1 can store into
    every cell of its own even after another writer fills the tmpfs."""
    path = agent_region(str(small_tmpfs), "eng", 128, CELL, 2, populate=False)
    assert allocated_bytes(path) == 0
    region = attach_region(str(small_tmpfs), "eng", TWO_WORKERS, 1, 2.0)
    try:
        assert allocated_bytes(path) == 128 * CELL  # worker 1's cells, not worker 0's
        fill(small_tmpfs)
        cells = [
            row * TWO_WORKERS.row_stride + CELL + at for row in range(128) for at in (0, CELL - 1)
        ]
        assert store_in_child(region.address, cells) == "exit 0"
    finally:
        region.cleanup()


def test_a_sparse_region_on_a_full_tmpfs_is_refused_with_sizes_not_sigbus(
    small_tmpfs: Path,
) -> None:
    path = agent_region(str(small_tmpfs), "eng", 128, CELL, 2, populate=False)
    fill(small_tmpfs)
    with pytest.raises(RegionCellsOutOfSpace) as caught:
        attach_region(str(small_tmpfs), "eng", TWO_WORKERS, 0, 2.0)
    message = str(caught.value)
    for part in (
        f"region {path} needs {128 * CELL} bytes but its filesystem has 0 bytes free",
        "while populating worker 0's cells at offset 0",
        "populate: false",
        "worker 0 allocates its own 8388608 bytes of cells",
    ):
        assert part in message, message
    # nothing held, nothing changed: the agent can still remove or reuse the region
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert os.path.getsize(path) == TWO_WORKERS.size_bytes
    # and the failed attach let go of rank 0: given room, worker 0 attaches
    os.unlink(small_tmpfs / "filler")
    attach_region(str(small_tmpfs), "eng", TWO_WORKERS, 0, 2.0).cleanup()


def test_a_fully_allocated_region_is_attached_without_allocating(shm_dir: Path) -> None:
    path = agent_region(str(shm_dir), "eng", 128, CELL, 2)
    region = attach_region(str(shm_dir), "eng", TWO_WORKERS, 0, 2.0)
    try:
        assert region.populate_method is None
        assert allocated_bytes(path) == TWO_WORKERS.size_bytes
    finally:
        region.cleanup()


def test_a_file_truncated_under_the_attach_is_told_as_changed_not_as_a_geometry(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region has vLLM's geometry; another process of the tenant truncates file 0 just
    after the worker opened it. The error must say the file changed size, not ask for another
    OffloadRegion layout."""
    path = agent_region(str(shm_dir), "eng", 128, CELL, 2)
    real_open = RegionFiles.open

    def truncated_after_opening(self: RegionFiles, *args: float) -> None:
        real_open(self, *args)
        os.truncate(path, 4096)

    monkeypatch.setattr(RegionFiles, "open", truncated_after_opening)
    with pytest.raises(RegionResizedError) as caught:
        attach_region(str(shm_dir), "eng", TWO_WORKERS, 0, 2.0)
    message = str(caught.value)
    assert f"{path} changed size before it was mapped: it is 4096 bytes" in message, message
    assert "must have layout" not in message


GIB_ROW = RegionGeometry(2560, MIB, MIB, 1, False)  # 2.5 GiB in two files


@pytest.mark.parametrize(
    ("agent_rows", "found"),
    [
        (
            3000,
            "2 files of the region (vllm_offload_eng.mmap, .mmap.1): 3145728000 bytes, 3000 rows",
        ),
        (
            3840,
            "3 files of the region (vllm_offload_eng.mmap, .mmap.1, .mmap.2): "
            "4026531840 bytes, 3840 rows",
        ),
        (1024, "1 file of the region (vllm_offload_eng.mmap): 1073741824 bytes, 1024 rows"),
        (1, "1 file of the region (vllm_offload_eng.mmap): 1048576 bytes, 1 row of"),
    ],
)
def test_a_mismatch_says_how_many_files_bytes_and_rows_the_region_has(
    shm_dir: Path, agent_rows: int, found: str
) -> None:
    """Sparse files of another numBlocks than vLLM's 2560: file 0 alone would say nothing of
    the region's size when it is split over files."""
    agent_region(str(shm_dir), "eng", agent_rows, MIB, 1, populate=False)
    with pytest.raises(RegionGeometryMismatch) as caught:
        attach_region(str(shm_dir), "eng", GIB_ROW, 0, 1.0)
    message = str(caught.value)
    for part in (
        "vLLM computed a CPU offload region of 2560 rows x 1048576 bytes",
        f"in all, {shm_dir} holds {found}",
        "must have layout: {format: vllm-0.33, numBlocks: 2560,",
    ):
        assert part in message, message
    assert RegionLayout(agent_rows, MIB, 1).size_bytes == sum(
        entry.stat().st_size for entry in shm_dir.iterdir()
    )  # left as it was


def test_a_populated_region_on_huge_pages_is_attached_whole_and_allocates_nothing(
    huge_tmpfs: Path, thp_fallbacks: Callable[[], int]
) -> None:
    path = agent_region(str(huge_tmpfs), "eng", 128, CELL, 2)
    region = attach_region(str(huge_tmpfs), "eng", TWO_WORKERS, 1, 2.0)
    try:
        assert region.populate_method is None and region.address % memory.HUGE_PAGE_SIZE == 0
        memory.madvise(region.address, TWO_WORKERS.size_bytes, memory.MADV_POPULATE_WRITE)
        size = TWO_WORKERS.size_bytes
        assert_mapped_huge(memory.huge_mapped_bytes(region.address, size), size, thp_fallbacks())
        assert allocated_bytes(path) == size
    finally:
        region.cleanup()


def test_a_sparse_region_on_huge_pages_gets_the_huge_pages_that_hold_this_workers_cells(
    huge_tmpfs: Path,
) -> None:
    """On huge pages a worker cannot allocate its cells alone: each 2 MiB page holds the cells
    of both workers of 16 rows, so allocating worker 1's cells allocates the whole region (the
    agent counts a sparse region's full size against capacity). A later store by either worker
    then finds its page there, even once another writer has filled the tmpfs."""
    path = agent_region(str(huge_tmpfs), "eng", 128, CELL, 2, populate=False)
    region = attach_region(str(huge_tmpfs), "eng", TWO_WORKERS, 1, 2.0)
    try:
        assert allocated_bytes(path) == TWO_WORKERS.size_bytes
        fill(huge_tmpfs)
        cells = [row * TWO_WORKERS.row_stride + at for row in range(128) for at in (0, CELL)]
        assert store_in_child(region.address, cells) == "exit 0"
    finally:
        region.cleanup()
