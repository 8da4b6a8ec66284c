from __future__ import annotations

import pytest

from kvshm.region import InvalidLayoutError, RegionFile, RegionFormat, RegionLayout

GIB = 1 << 30
UNPADDED = RegionFormat.UNPADDED


def test_unpadded_rows_are_exactly_the_cells() -> None:
    layout = RegionLayout(num_blocks=10, cpu_page_size=3000, num_workers=4, format=UNPADDED)
    assert layout.row_stride == 12000
    assert layout.size_bytes == 120000
    assert layout.cell_offset(0, 0) == 0
    assert layout.cell_offset(0, 3) == 9000
    assert layout.cell_offset(7, 2) == 7 * 12000 + 2 * 3000


@pytest.mark.parametrize("fmt", ["vllm-0.33", "vllm-0.27", RegionFormat.VLLM_0_27])
def test_vllm_rows_are_padded_to_4096_bytes(fmt: str) -> None:
    layout = RegionLayout(10, 3000, 4, fmt)  # type: ignore[arg-type]
    assert layout.format is RegionFormat(fmt)
    assert layout.row_stride == 12288  # round_up(3000 x 4, 4096)
    assert layout.size_bytes == 10 * 12288
    assert layout.cell_offset(7, 2) == 7 * 12288 + 2 * 3000  # cells are not padded, rows are
    assert RegionLayout(10, 4096, 3).row_stride == 3 * 4096  # aligned rows stay as they are


def test_replicated_rows_hold_one_cell_every_rank_shares() -> None:
    layout = RegionLayout(5, 3000, 4, replicated=True)
    assert layout.row_stride == 4096  # round_up(3000 x 1, 4096)
    assert {layout.cell_offset(3, rank) for rank in range(4)} == {3 * 4096}
    assert layout.rank_ranges(2, 4096) == layout.rank_ranges(0, 4096)
    with pytest.raises(InvalidLayoutError, match=r"rank must be an integer in \[0, 4\)"):
        layout.cell_offset(0, 4)


def test_the_default_format_is_vllm_0_33_unreplicated() -> None:
    layout = RegionLayout(1, 4096, 1)
    assert layout.format is RegionFormat.VLLM_0_33 and layout.replicated is False


def test_a_region_below_2_gib_is_one_file_in_every_format() -> None:
    for fmt in RegionFormat:
        layout = RegionLayout(2 * 1024 - 1, 1 << 20, 1, fmt)  # 1 MiB short of 2 GiB
        assert layout.files("e") == [RegionFile("vllm_offload_e.mmap", 0, layout.size_bytes)]


def test_vllm_0_33_splits_64_gib_of_llama_70b_tp4_over_32_files() -> None:
    # vLLM's per-worker cell for Llama-3.1-70B, TP 4, block size 16: 1,310,720 bytes
    layout = RegionLayout(13107, 1310720, 4)
    stride = 4 * 1310720
    assert layout.row_stride == stride and layout.size_bytes // GIB == 63
    files = layout.files("llama")
    # n = min(32, 63) = 32 files of ceil(13107 / 32) = 410 rows, the last one the 397 left
    assert len(files) == layout.file_count == 32
    assert files[0] == RegionFile("vllm_offload_llama.mmap", 0, 410 * stride)
    assert files[1] == RegionFile("vllm_offload_llama.mmap.1", 410 * stride, 410 * stride)
    assert files[31] == RegionFile("vllm_offload_llama.mmap.31", 31 * 410 * stride, 397 * stride)


def test_vllm_0_33_may_make_fewer_files_than_it_asks_for() -> None:
    # 10 rows of 640 MiB = 6.25 GiB: n = 6, ceil(10 / 6) = 2 rows per file, so 5 files
    layout = RegionLayout(10, 640 << 20, 1)
    assert layout.rows_per_file == 2
    assert [f.name for f in layout.files("x")] == ["vllm_offload_x.mmap"] + [
        f"vllm_offload_x.mmap.{i}" for i in range(1, 5)
    ]
    # exactly 2 GiB: two files of one row
    assert RegionLayout(2, GIB, 1).file_ranges() == [(0, GIB), (GIB, GIB)]


@pytest.mark.parametrize(
    ("blocks", "page", "workers", "fmt"),
    [
        (13107, 1310720, 4, "vllm-0.33"),
        (7, 3 * GIB, 1, "vllm-0.33"),
        (100, 1 << 28, 3, "vllm-0.27"),
    ],
)
def test_files_tile_the_region_on_row_boundaries(
    blocks: int, page: int, workers: int, fmt: str
) -> None:
    layout = RegionLayout(blocks, page, workers, fmt)  # type: ignore[arg-type]
    offset = 0
    for file in layout.files("t"):
        assert file.offset == offset and file.length > 0
        assert file.offset % layout.row_stride == 0 and file.length % layout.row_stride == 0
        offset += file.length
    assert offset == layout.size_bytes
    assert len(layout.files("t")) == (1 if fmt == "vllm-0.27" else layout.file_count)


def test_vllm_0_27_is_always_one_file() -> None:
    layout = RegionLayout(64, GIB, 1, RegionFormat.VLLM_0_27)
    assert layout.files("big") == [RegionFile("vllm_offload_big.mmap", 0, 64 * GIB)]


def test_replicated_unpadded_and_unknown_formats_are_refused() -> None:
    with pytest.raises(InvalidLayoutError, match=r"replicated layout needs format vllm-0\.33"):
        RegionLayout(1, 4096, 2, UNPADDED, replicated=True)
    with pytest.raises(InvalidLayoutError, match=r"format must be one of vllm-0\.33, vllm-0\.27"):
        RegionLayout(1, 4096, 2, "vllm-0.26")  # type: ignore[arg-type]
    with pytest.raises(InvalidLayoutError, match="replicated must be true or false"):
        RegionLayout(1, 4096, 2, replicated="yes")  # type: ignore[arg-type]


def test_the_size_limit_counts_the_padding() -> None:
    RegionLayout(2**51 - 1, 1, 1)  # 4096-byte padded rows: 2^63 - 4096 bytes
    with pytest.raises(InvalidLayoutError, match="ask for fewer blocks"):
        RegionLayout(2**51, 1, 1)
    RegionLayout(2**51, 1, 1, UNPADDED)


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
    layout = RegionLayout(num_blocks=3, cpu_page_size=6000, num_workers=2, format=UNPADDED)
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
    layout = RegionLayout(num_blocks=10, cpu_page_size=1000, num_workers=3, format=UNPADDED)
    chunks = layout.row_aligned_chunks(max_chunk_bytes=7000)  # two rows of 3000 fit
    assert chunks == [(0, 6000), (6000, 6000), (12000, 6000), (18000, 6000), (24000, 6000)]
    assert sum(length for _, length in chunks) == layout.size_bytes
    # a row larger than the limit still gets a piece of its own
    assert layout.row_aligned_chunks(max_chunk_bytes=100)[0] == (0, 3000)


def test_registration_ranges_are_a_workers_cells_only_where_a_row_leaves_out_enough() -> None:
    mib = 1024**2
    # 70B at TP 4: 1.25 MiB cells, 5 MiB rows: rank 2 registers its cells, one piece a row
    layout = RegionLayout(num_blocks=3, cpu_page_size=1280 * 1024, num_workers=4)
    assert layout.registers_cells_alone(2, 4096)
    cell = 1280 * 1024
    assert layout.registration_ranges(2, 4096, 64 * 1024**3) == [
        (row * 5 * mib + 2 * cell, cell) for row in range(3)
    ]
    # no rank, or too little left out per row (448 KiB cells of 2 workers): whole rows
    assert layout.registration_ranges(None, 4096, 64 * 1024**3) == [(0, 15 * mib)]
    small = RegionLayout(num_blocks=4, cpu_page_size=448 * 1024, num_workers=2)
    assert not small.registers_cells_alone(1, 4096)
    assert small.registration_ranges(1, 4096, 64 * 1024**3) == [(0, small.size_bytes)]
    # 2 MiB left out a row: about even on an H100, so whole rows
    assert not RegionLayout(
        num_blocks=4, cpu_page_size=2 * mib, num_workers=2
    ).registers_cells_alone(1, 4096)
    # replicated: every worker uses the one copy, so the whole row
    shared = RegionLayout(num_blocks=4, cpu_page_size=4 * mib, num_workers=4, replicated=True)
    assert not shared.registers_cells_alone(3, 4096)


def test_a_cell_starting_mid_page_is_widened_to_whole_pages() -> None:
    # 3 workers of 3 MiB + 1000 bytes: rank 1's cell starts 1000 bytes into a page
    cell = 3 * 1024**2 + 1000
    layout = RegionLayout(num_blocks=2, cpu_page_size=cell, num_workers=3)
    offset, length = layout.cell_pages(1, 4096)
    assert offset == cell - cell % 4096 and (offset + length) % 4096 == 0
    assert offset + length >= 2 * cell and length < 2 * 4096 + cell
    assert layout.registers_cells_alone(1, 4096)
    ranges = layout.registration_ranges(1, 4096, 64 * 1024**3)
    assert ranges[1][0] == layout.row_stride + offset
    # unpadded rows that are not whole pages: a page could hold two rows' cells, so whole rows
    unpadded = RegionLayout(num_blocks=2, cpu_page_size=cell, num_workers=3, format=UNPADDED)
    assert not unpadded.registers_cells_alone(1, 4096)


HUGE = 2 * 1024 * 1024


def test_huge_page_tails_and_what_a_rounding_filesystem_holds() -> None:
    # Llama-3.1-70B at TP 4, 64 GiB: 32 files of 410 rows and one of 397; 5 MiB rows make a
    # file of an odd number of rows end 1 MiB into a huge page
    layout = RegionLayout(13107, 1310720, 4)
    assert layout.file_count == 32 and layout.rows_per_file == 410
    assert layout.huge_page_tail_bytes(HUGE) == 1 << 20  # the last file's 397 rows
    assert layout.whole_huge_page_bytes(HUGE) == layout.size_bytes - (1 << 20)
    assert layout.allocation_bytes(HUGE) == layout.size_bytes + (1 << 20)
    assert layout.allocation_bytes(4096) == layout.size_bytes


def test_the_largest_layout_of_whole_huge_page_files_loses_a_row_here() -> None:
    layout = RegionLayout(13107, 1310720, 4)
    aligned = layout.with_whole_huge_pages(HUGE)
    assert aligned == RegionLayout(13106, 1310720, 4)
    assert aligned.huge_page_tail_bytes(HUGE) == 0
    assert aligned.whole_huge_page_bytes(HUGE) == aligned.size_bytes


def test_whole_huge_page_files_need_rows_in_steps_the_row_stride_sets() -> None:
    # 4096-byte rows: 512 to a huge page; 3 MiB rows: 2 to a huge page
    assert RegionLayout(1000, 4096, 1).with_whole_huge_pages(HUGE).num_blocks == 512
    assert RegionLayout(685, 786432, 4).with_whole_huge_pages(HUGE).num_blocks == 684
    # too small for one huge page: left as it is
    small = RegionLayout(3, 4096, 1)
    assert small.with_whole_huge_pages(HUGE) is small
