"""The byte layout of a region: one row per block, one cell per worker in each row."""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.region.errors import InvalidLayoutError

MAX_REGION_BYTES = 2**63 - 1  # off_t and Kubernetes' int64 both stop here


@dataclass(frozen=True)
class RegionLayout:
    """numBlocks rows of numWorkers cells, each cell cpuPageSize bytes.

    Block b's row starts at b * row_stride; worker r's cell in it at r * cpu_page_size.
    This is vLLM's layout byte for byte.
    """

    num_blocks: int
    cpu_page_size: int
    num_workers: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "cpu_page_size", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidLayoutError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise InvalidLayoutError(f"{name} must be at least 1, got {value}")
        if self.num_blocks * self.cpu_page_size * self.num_workers > MAX_REGION_BYTES:
            raise InvalidLayoutError(
                f"{self.num_blocks} blocks x {self.cpu_page_size} bytes x {self.num_workers} "
                f"workers is more than {MAX_REGION_BYTES} bytes: ask for fewer blocks"
            )

    @property
    def row_stride(self) -> int:
        """Bytes from one block's row to the next: all workers' cells of one block."""
        return self.cpu_page_size * self.num_workers

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.row_stride

    def check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_workers:
            raise InvalidLayoutError(
                f"rank must be an integer in [0, {self.num_workers}), got {rank!r}"
            )

    def cell_offset(self, block: int, rank: int) -> int:
        """Byte offset of worker `rank`'s cell in block `block`'s row."""
        self.check_rank(rank)
        if not 0 <= block < self.num_blocks:
            raise InvalidLayoutError(f"block must be in [0, {self.num_blocks}), got {block}")
        return block * self.row_stride + rank * self.cpu_page_size

    def rank_ranges(self, rank: int, page_size: int) -> list[tuple[int, int]]:
        """(offset, length) of worker `rank`'s cell in every row, each widened down to a page.

        Adjacent ranges that touch are merged, so a worker whose cells fill whole pages
        gets few large ranges instead of one per block.
        """
        self.check_rank(rank)
        ranges: list[tuple[int, int]] = []
        for block in range(self.num_blocks):
            start = block * self.row_stride + rank * self.cpu_page_size
            aligned = start - start % page_size
            end = start + self.cpu_page_size
            if ranges and ranges[-1][0] + ranges[-1][1] >= aligned:
                first = ranges[-1][0]
                ranges[-1] = (first, max(end, first + ranges[-1][1]) - first)
            else:
                ranges.append((aligned, end - aligned))
        return ranges

    def row_aligned_chunks(self, max_chunk_bytes: int) -> list[tuple[int, int]]:
        """(offset, length) pieces of the whole region, each at most max_chunk_bytes (or one
        row, if a row is larger) and each ending on a row boundary, so no block straddles two."""
        rows_per_chunk = max(1, max_chunk_bytes // self.row_stride)
        chunks = []
        for first_row in range(0, self.num_blocks, rows_per_chunk):
            rows = min(rows_per_chunk, self.num_blocks - first_row)
            chunks.append((first_row * self.row_stride, rows * self.row_stride))
        return chunks
