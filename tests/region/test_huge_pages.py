"""Regions on a tmpfs mounted with huge pages (huge=within_size, huge=advise), real mounts: the
kernel's own counts (smaps' ShmemPmdMapped, st_blocks) say which pages a region got."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.agent_region import agent_made_region, attach_as_worker
from tests.conftest import mounted_tmpfs

from kvshm.region import (
    RegionFormat,
    RegionLayout,
    RegionResizedError,
    RegionSpaceError,
    SharedOffloadRegion,
    memory,
)

MIB = 1 << 20
HUGE = memory.HUGE_PAGE_SIZE


def populate_range(region: SharedOffloadRegion, offset: int, length: int) -> None:
    memory.madvise(region.address + offset, length, memory.MADV_POPULATE_WRITE)


def test_a_region_on_a_huge_tmpfs_is_populated_with_whole_huge_pages(huge_tmpfs: Path) -> None:
    layout = RegionLayout(24, MIB, 2)  # 48 MiB, one file
    with SharedOffloadRegion("h", layout, directory=str(huge_tmpfs), mode="create") as region:
        assert region.address % HUGE == 0
        assert memory.huge_mapped_bytes(region.address, layout.size_bytes) == layout.size_bytes
        # no rounding: the file holds exactly its size
        assert region.allocated_bytes() == layout.size_bytes


def test_the_same_region_on_a_tmpfs_without_huge_pages_gets_small_ones(
    small_tmpfs: Path,
) -> None:
    layout = RegionLayout(24, MIB, 2)
    with SharedOffloadRegion("h", layout, directory=str(small_tmpfs), mode="create") as region:
        assert region.is_fully_allocated()
        assert memory.huge_mapped_bytes(region.address, layout.size_bytes) == 0


def test_a_tmpfs_mounted_huge_advise_gives_regions_huge_pages_because_they_ask() -> None:
    """huge=advise gives huge pages only to mappings that ask (MADV_HUGEPAGE): every region
    mapping does, so the agent's populate gets them there too."""
    with mounted_tmpfs("size=64m,huge=advise") as directory:
        layout = RegionLayout(16, MIB, 1)
        with SharedOffloadRegion("a", layout, directory=str(directory), mode="create") as region:
            assert memory.huge_mapped_bytes(region.address, layout.size_bytes) == layout.size_bytes


def test_an_attacher_maps_the_agents_huge_pages_whole(huge_tmpfs: Path) -> None:
    layout = RegionLayout(16, MIB, 2)
    creator = agent_made_region(huge_tmpfs, "w", layout, populate=True)
    try:
        worker = attach_as_worker(huge_tmpfs, "w", layout, 1)
        try:
            assert worker.address % HUGE == 0 and worker.populate_method is None
            populate_range(worker, 0, layout.size_bytes)  # maps what is there, allocates none
            assert memory.huge_mapped_bytes(worker.address, layout.size_bytes) == layout.size_bytes
            assert creator.allocated_bytes() == layout.size_bytes
        finally:
            worker.cleanup()
    finally:
        creator.cleanup()


def test_a_file_that_is_not_whole_huge_pages_keeps_its_tail_on_small_pages(
    huge_tmpfs: Path,
) -> None:
    """within_size: a huge page only where it lies wholly inside the file. 5 rows of 1.5 MiB
    are 7.5 MiB: three huge pages and 1.5 MiB on 4 KiB pages, no byte more allocated."""
    layout = RegionLayout(5, 3 * MIB // 2, 1)
    assert layout.huge_page_tail_bytes(HUGE) == 3 * MIB // 2
    with SharedOffloadRegion("t", layout, directory=str(huge_tmpfs), mode="create") as region:
        mapped = memory.huge_mapped_bytes(region.address, layout.size_bytes)
        assert mapped == layout.whole_huge_page_bytes(HUGE) == 6 * MIB
        assert region.allocated_bytes() == layout.size_bytes == layout.allocation_bytes(4096)


@pytest.mark.parametrize(
    ("row_mib", "rows", "huge_files"),
    [(5, 412, 2), (3, 685, 1)],
    ids=["files-of-whole-huge-pages", "first-file-not-whole-huge-pages"],
)
def test_every_file_of_a_segmented_region_starts_on_a_huge_page_boundary(
    row_mib: int, rows: int, huge_files: int
) -> None:
    """A region of 2 GiB or more is several files mapped back to back (vLLM 0.33's split).
    kvshm maps them from a huge-page boundary, so each file whose offset is whole huge pages
    gets them; a file after one that is not whole huge pages starts off a boundary and gets
    none (the layout says so: whole_huge_page_bytes). 412 rows of 5 MiB are 2 files of 1030
    MiB; 685 rows of 3 MiB are 1029 + 1026 MiB. Sparse, only each file's first huge page
    populated: a few MiB of a 2 GiB region."""
    layout = RegionLayout(rows, row_mib * MIB // 4, 4, RegionFormat.VLLM_0_33)
    assert layout.file_count == 2
    with mounted_tmpfs("size=3g,huge=within_size") as directory:
        creator = agent_made_region(directory, "seg", layout, populate=False)
        try:
            assert creator.address % HUGE == 0
            got = 0
            for file in layout.files("seg"):
                populate_range(creator, file.offset, HUGE)
                mapped = memory.huge_mapped_bytes(creator.address + file.offset, file.length)
                assert mapped == (HUGE if file.offset < layout.whole_huge_page_bytes(HUGE) else 0)
                got += mapped // HUGE
            assert got == huge_files
            assert creator.allocated_bytes() == layout.file_count * HUGE
        finally:
            creator.cleanup()


def test_a_full_huge_tmpfs_is_an_error_with_sizes_not_sigbus(huge_tmpfs: Path) -> None:
    with agent_made_region(huge_tmpfs, "sparse", RegionLayout(48, MIB, 1), populate=False):
        (huge_tmpfs / "filler").write_bytes(b"\1" * (40 * MIB))
        with pytest.raises(RegionSpaceError, match="while populating at offset"):
            SharedOffloadRegion(
                "sparse", RegionLayout(48, MIB, 1), directory=str(huge_tmpfs), populate=True
            )


def test_a_huge_page_file_truncated_before_populate_is_told_as_changed_not_sigbus(
    huge_tmpfs: Path,
) -> None:
    """A tenant truncates the file between the agent's mapping and its populate: the populate
    says the file changed size (no SIGBUS, no "out of space")."""
    layout = RegionLayout(8, MIB, 1)
    creator = agent_made_region(huge_tmpfs, "cut", layout, populate=False)
    try:
        os.truncate(creator.mmap_path, 3 * MIB)
        with pytest.raises(RegionResizedError, match="changed size while it was being populated"):
            creator.populate()
        assert os.stat(creator.mmap_path).st_size == 3 * MIB
    finally:
        creator.cleanup()
