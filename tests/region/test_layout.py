from __future__ import annotations

import pytest

from kvshm.region import InvalidLayoutError, RegionLayout


def test_sizes_and_offsets_follow_vllm_layout() -> None:
    layout = RegionLayout(num_blocks=10, cpu_page_size=3000, num_workers=4)
    assert layout.row_stride == 12000
    assert layout.size_bytes == 120000
    assert layout.cell_offset(0, 0) == 0
    assert layout.cell_offset(0, 3) == 9000
    assert layout.cell_offset(7, 2) == 7 * 12000 + 2 * 3000


@pytest.mark.parametrize(
    ("blocks", "page", "workers", "message"),
    [
        (0, 4096, 1, "num_blocks must be at least 1"),
        (1, 0, 1, "cpu_page_size must be at least 1"),
        (1, 4096, -2, "num_workers must be at least 1"),
        (1.5, 4096, 1, "num_blocks must be an integer"),
        (True, 4096, 1, "num_blocks must be an integer"),
        (2**40, 2**20, 2**4, "ask for fewer blocks"),
    ],
)
def test_invalid_layouts_say_what_is_wrong(
    blocks: int, page: int, workers: int, message: str
) -> None:
    with pytest.raises(InvalidLayoutError, match=message):
        RegionLayout(blocks, page, workers)


def test_rank_ranges_cover_each_cell_widened_to_pages() -> None:
    layout = RegionLayout(num_blocks=3, cpu_page_size=6000, num_workers=2)
    # rank 1's cells start at 6000, 18000, 30000: widened down to 4096, 16384, 28672
    assert layout.rank_ranges(1, 4096) == [(4096, 7904), (16384, 7616), (28672, 7328)]
    for offset, _length in layout.rank_ranges(1, 4096):
        assert offset % 4096 == 0
    ranks0 = layout.rank_ranges(0, 4096)
    assert ranks0[0] == (0, 6000)


def test_rank_ranges_merge_when_cells_touch() -> None:
    layout = RegionLayout(num_blocks=8, cpu_page_size=8192, num_workers=1)
    assert layout.rank_ranges(0, 4096) == [(0, 8 * 8192)]


def test_rank_out_of_range() -> None:
    with pytest.raises(InvalidLayoutError, match=r"rank must be an integer in \[0, 2\)"):
        RegionLayout(4, 4096, 2).rank_ranges(2, 4096)


def test_row_aligned_chunks_end_on_rows_and_cover_everything() -> None:
    layout = RegionLayout(num_blocks=10, cpu_page_size=1000, num_workers=3)
    chunks = layout.row_aligned_chunks(max_chunk_bytes=7000)  # two rows of 3000 fit
    assert chunks == [(0, 6000), (6000, 6000), (12000, 6000), (18000, 6000), (24000, 6000)]
    assert sum(length for _, length in chunks) == layout.size_bytes
    # a row larger than the limit still gets a piece of its own
    assert layout.row_aligned_chunks(max_chunk_bytes=100)[0] == (0, 3000)
