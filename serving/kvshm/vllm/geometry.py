"""The region vLLM 0.33 computes for an engine, as kvshm and the OffloadRegion CR name it."""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.region import RegionFormat, RegionLayout


@dataclass(frozen=True)
class RegionGeometry:
    """num_chunks rows of row_stride bytes; worker r's cell in a row starts at r * cpu_page_size
    (every worker uses cell 0 when replicated). row_stride is vLLM's kv_bytes_per_chunk: the
    cells of one row rounded up to 4096 bytes."""

    num_chunks: int
    row_stride: int
    cpu_page_size: int
    num_workers: int
    replicated: bool

    @property
    def copies(self) -> int:
        """Cells per row: one per worker, or one shared copy (MLA's replicated layout)."""
        return 1 if self.replicated else self.num_workers

    @property
    def size_bytes(self) -> int:
        return self.num_chunks * self.row_stride

    def region_layout(self) -> RegionLayout:
        """kvshm's layout of this region: vLLM 0.33's format (padded rows, split files)."""
        return RegionLayout(
            self.num_chunks,
            self.cpu_page_size,
            self.num_workers,
            format=RegionFormat.VLLM_0_33,
            replicated=self.replicated,
        )

    def describe(self) -> str:
        return (
            f"{self.num_chunks} rows x {self.row_stride} bytes = {self.size_bytes} bytes, "
            f"cells of {self.cpu_page_size} bytes x {self.copies}"
            + (" (replicated)" if self.replicated else "")
        )

    def offload_region_layout(self) -> str:
        """The OffloadRegion spec.layout that matches this geometry."""
        return (
            f"layout: {{format: vllm-0.33, numBlocks: {self.num_chunks}, "
            f"cpuPageSize: {self.cpu_page_size}, numWorkers: {self.num_workers}, "
            f"replicated: {str(self.replicated).lower()}}}"
        )
