"""The byte layout of a region: one row per block, one cell per worker in each row, and the files
the rows are split over. Each format is the layout of the vLLM releases it names, byte for byte."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from kvshm.region.errors import InvalidLayoutError
from kvshm.region.naming import MAX_SEGMENTS, segment_file_name

MAX_REGION_BYTES = 2**63 - 1  # off_t and Kubernetes' int64 both stop here
ROW_ALIGNMENT = 4096  # vLLM pads rows to its BLOCK_SIZE_ALIGNMENT, the x86-64 page size
MIN_SEGMENT_BYTES = 1 << 30  # vLLM 0.33 gives no file less than 1 GiB
# Registering a worker's cells alone costs a CUDA call and a prefault per row: worth it only
# when each row leaves out enough (docs/benchmarks.md, "a worker's cells alone against whole
# rows"). vLLM 0.33 uses the same 3 MiB for its slots.
MIN_UNREGISTERED_BYTES_PER_ROW = 3 << 20


class RegionFormat(StrEnum):
    VLLM_0_33 = "vllm-0.33"
    """vLLM 0.33 and later: rows padded to 4096 bytes, split over up to 32 files."""
    VLLM_0_27 = "vllm-0.27"
    """vLLM 0.27 to 0.32: rows padded to 4096 bytes, one file."""
    UNPADDED = "unpadded"
    """kvshm's first layout: rows of exactly numWorkers cells, one file. No vLLM release pads
    nothing, so vLLM only attaches it when cpuPageSize x numWorkers is a multiple of 4096."""


@dataclass(frozen=True)
class RegionFile:
    """One file of a region: its name and the bytes of the region it holds."""

    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class RegionLayout:
    """numBlocks rows; a row holds numWorkers cells of cpuPageSize bytes (one cell, shared by
    every worker, when replicated), padded as the format says.

    Block b's row starts at b * row_stride; worker r's cell in it at r * cpu_page_size (at 0 for
    every worker when replicated). The rows are split over files as `files()` lists them.
    """

    num_blocks: int
    cpu_page_size: int
    num_workers: int
    format: RegionFormat = RegionFormat.VLLM_0_33
    replicated: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "cpu_page_size", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidLayoutError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise InvalidLayoutError(f"{name} must be at least 1, got {value}")
        try:
            object.__setattr__(self, "format", RegionFormat(self.format))
        except ValueError:
            known = ", ".join(f.value for f in RegionFormat)
            raise InvalidLayoutError(
                f"format must be one of {known}; got {self.format!r}"
            ) from None
        if not isinstance(self.replicated, bool):
            raise InvalidLayoutError(f"replicated must be true or false, got {self.replicated!r}")
        if self.replicated and self.format is RegionFormat.UNPADDED:
            raise InvalidLayoutError(
                "a replicated layout needs format vllm-0.33 or vllm-0.27 (the vLLM releases that "
                "map one shared copy per row); unpadded rows always hold one cell per worker"
            )
        if self.num_blocks * self.row_stride > MAX_REGION_BYTES:
            raise InvalidLayoutError(
                f"{self.num_blocks} blocks x {self.row_stride} bytes per row is more than "
                f"{MAX_REGION_BYTES} bytes: ask for fewer blocks"
            )

    @property
    def cells_per_row(self) -> int:
        return 1 if self.replicated else self.num_workers

    @property
    def row_stride(self) -> int:
        """Bytes from one block's row to the next."""
        cells = self.cpu_page_size * self.cells_per_row
        if self.format is RegionFormat.UNPADDED:
            return cells
        return -(-cells // ROW_ALIGNMENT) * ROW_ALIGNMENT

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.row_stride

    def check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_workers:
            raise InvalidLayoutError(
                f"rank must be an integer in [0, {self.num_workers}), got {rank!r}"
            )

    def cell_start(self, rank: int) -> int:
        """Offset of worker `rank`'s cell within a row (0 for everyone when replicated)."""
        self.check_rank(rank)
        return 0 if self.replicated else rank * self.cpu_page_size

    def cell_offset(self, block: int, rank: int) -> int:
        """Byte offset of worker `rank`'s cell in block `block`'s row."""
        if not 0 <= block < self.num_blocks:
            raise InvalidLayoutError(f"block must be in [0, {self.num_blocks}), got {block}")
        return block * self.row_stride + self.cell_start(rank)

    def rank_ranges(self, rank: int, page_size: int) -> list[tuple[int, int]]:
        """(offset, length) of worker `rank`'s cell in every row, each widened down to a page.

        Adjacent ranges that touch are merged, so a worker whose cells fill whole pages
        gets few large ranges instead of one per block.
        """
        cell_start = self.cell_start(rank)
        ranges: list[tuple[int, int]] = []
        for block in range(self.num_blocks):
            start = block * self.row_stride + cell_start
            aligned = start - start % page_size
            end = start + self.cpu_page_size
            if ranges and ranges[-1][0] + ranges[-1][1] >= aligned:
                first = ranges[-1][0]
                ranges[-1] = (first, max(end, first + ranges[-1][1]) - first)
            else:
                ranges.append((aligned, end - aligned))
        return ranges

    def cell_pages(self, rank: int, page_size: int) -> tuple[int, int]:
        """(offset in the row, length) of worker `rank`'s cell widened out to whole pages."""
        start = self.cell_start(rank)
        first = start - start % page_size
        return first, -(-(start + self.cpu_page_size) // page_size) * page_size - first

    def registers_cells_alone(self, rank: int, page_size: int) -> bool:
        """Whether worker `rank` should register only its cells with CUDA rather than whole
        rows: not when every worker maps the one shared copy (replicated), not when a page can
        hold two rows' cells (rows not whole pages: registrations must not overlap), and not
        when a row would leave out less than MIN_UNREGISTERED_BYTES_PER_ROW."""
        if self.replicated or self.row_stride % page_size:
            return False
        _, length = self.cell_pages(rank, page_size)
        return self.row_stride - length >= MIN_UNREGISTERED_BYTES_PER_ROW

    def registration_ranges(
        self, rank: int | None, page_size: int, max_chunk_bytes: int
    ) -> list[tuple[int, int]]:
        """(offset, length) pieces to register with CUDA for worker `rank` (None: the whole
        region): its cells widened to pages, one piece per row, when registers_cells_alone
        says so; else row_aligned_chunks. No piece splits a cell."""
        if rank is None or not self.registers_cells_alone(rank, page_size):
            return self.row_aligned_chunks(max_chunk_bytes)
        offset, length = self.cell_pages(rank, page_size)
        return [(row * self.row_stride + offset, length) for row in range(self.num_blocks)]

    def row_aligned_chunks(self, max_chunk_bytes: int) -> list[tuple[int, int]]:
        """(offset, length) pieces of the whole region, each at most max_chunk_bytes (or one
        row, if a row is larger) and each ending on a row boundary, so no block straddles two."""
        rows_per_chunk = max(1, max_chunk_bytes // self.row_stride)
        chunks = []
        for first_row in range(0, self.num_blocks, rows_per_chunk):
            rows = min(rows_per_chunk, self.num_blocks - first_row)
            chunks.append((first_row * self.row_stride, rows * self.row_stride))
        return chunks

    @property
    def rows_per_file(self) -> int:
        """vLLM 0.33: n = min(32, size // 1 GiB) files of ceil(rows / n) rows, the last takes
        the rest (so there may be fewer than n). Other formats: all rows in one file."""
        if self.format is not RegionFormat.VLLM_0_33:
            return self.num_blocks
        files = min(MAX_SEGMENTS, self.size_bytes // MIN_SEGMENT_BYTES)
        return max(1, -(-self.num_blocks // max(1, files)))

    @property
    def file_count(self) -> int:
        return -(-self.num_blocks // self.rows_per_file)

    def file_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) in the region of each file, file 0 first; they tile the region."""
        rows = self.rows_per_file
        return [
            (first * self.row_stride, min(rows, self.num_blocks - first) * self.row_stride)
            for first in range(0, self.num_blocks, rows)
        ]

    def files(self, instance_id: str) -> list[RegionFile]:
        """The region's files as vLLM names and maps them: vllm_offload_<id>.mmap, then
        vllm_offload_<id>.mmap.1, .2, ..., mapped back to back in this order."""
        return [
            RegionFile(segment_file_name(instance_id, index), offset, length)
            for index, (offset, length) in enumerate(self.file_ranges())
        ]

    def huge_page_tail_bytes(self, huge_page: int) -> int:
        """Bytes at the end of the files that no whole huge page covers (each file's length
        modulo huge_page), summed: the files are vLLM's split, so only numBlocks decides this.
        A file's pages start on a huge-page boundary only if every file before it is whole
        huge pages; where one is not, the files after it cannot be mapped with huge pages
        either (see whole_huge_page_bytes)."""
        return sum(length % huge_page for _, length in self.file_ranges())

    def whole_huge_page_bytes(self, huge_page: int) -> int:
        """Bytes of the region a process mapping it on a huge-page boundary (as kvshm does)
        can map with huge pages: the whole huge pages of each file until the first file whose
        length is not a multiple of huge_page (its tail, and every file after it, starts off a
        huge-page boundary in the mapping)."""
        total = 0
        for _, length in self.file_ranges():
            total += length - length % huge_page
            if length % huge_page:
                break
        return total

    def allocation_bytes(self, unit: int) -> int:
        """Bytes a filesystem that allocates every file in whole units of `unit` bytes (a tmpfs
        that rounds a file's last huge page up) holds for the region."""
        return sum(-(-length // unit) * unit for _, length in self.file_ranges())

    def with_whole_huge_pages(self, huge_page: int) -> RegionLayout:
        """The largest layout of at most num_blocks rows (same cells, format, workers) whose
        every file is whole huge pages, so the whole region can be mapped with them; this
        layout itself if it already is, or if not even one huge page's worth of rows fits."""
        step = huge_page // math.gcd(self.row_stride, huge_page)  # rows per whole huge pages
        blocks = self.num_blocks - self.num_blocks % step
        while blocks >= step:
            candidate = replace(self, num_blocks=blocks)
            if candidate.huge_page_tail_bytes(huge_page) == 0:
                return candidate
            blocks -= step
        return self

    def describe(self) -> str:
        copies = "one shared cell" if self.replicated else f"{self.num_workers} cells"
        return (
            f"{self.num_blocks} rows of {copies} of {self.cpu_page_size} bytes "
            f"({self.format.value}: {self.row_stride}-byte rows, {self.file_count} file"
            f"{'' if self.file_count == 1 else 's'})"
        )
