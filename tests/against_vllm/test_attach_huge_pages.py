"""vLLM 0.33's own SharedOffloadRegion attaches a region the agent made and populated on a
tmpfs mounted huge=within_size: one process per rank, the region's directory as /dev/shm, a
single file and a segmented region (32 files are vLLM's split; these rows make every file whole
huge pages). What vLLM writes kvshm reads and the reverse, and the pages stay huge pages
through vLLM's attach, its per-rank populate and its stores."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvshm.region import RegionFormat, RegionLayout, memory
from tests.against_vllm.exchange import around_file_boundaries, exchange_with_vllm
from tests.agent_region import agent_made_region, attach_as_worker
from tests.conftest import mounted_tmpfs
from tests.huge_pages import assert_mapped_huge

TENSORS, TENSOR_PAGE = 4, 16384  # 64 KiB cells: rows of whole pages, 32 rows a huge page at TP 1
HUGE = memory.HUGE_PAGE_SIZE


@pytest.mark.parametrize(
    ("world", "rows"),
    [(2, 256), (4, (2 << 30) // (4 * 65536) + 128)],  # 32 MiB in one file; 2 GiB + 32 MiB, 2 files
    ids=["one-file", "segmented"],
)
def test_vllm_attaches_an_agent_region_on_huge_pages(
    tmp_path: Path, world: int, rows: int, thp_fallbacks: Callable[[], int]
) -> None:
    cell = TENSORS * TENSOR_PAGE
    layout = RegionLayout(rows, cell, world, RegionFormat.VLLM_0_33)
    assert layout.huge_page_tail_bytes(HUGE) == 0
    with mounted_tmpfs(f"size={layout.size_bytes + (64 << 20)},huge=within_size") as tmpfs:
        region_dir = tmpfs / "serving" / "huge"
        region_dir.mkdir(parents=True)
        creator = agent_made_region(region_dir, "huge", layout, populate=True)
        try:
            blocks = around_file_boundaries(layout, "huge")
            exchange_with_vllm(region_dir, "huge", layout, blocks, TENSORS, tmp_path)
            # still every page a huge page, and no page more: mapped whole by an attacher
            assert creator.allocated_bytes() == layout.size_bytes
            reader = attach_as_worker(region_dir, "huge", layout, 0)
            try:
                memory.madvise(reader.address, layout.size_bytes, memory.MADV_POPULATE_WRITE)
                mapped = memory.huge_mapped_bytes(reader.address, layout.size_bytes)
                assert_mapped_huge(mapped, layout.size_bytes, thp_fallbacks())
            finally:
                reader.cleanup()
        finally:
            creator.cleanup()
