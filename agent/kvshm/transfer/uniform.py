"""Uniform jobs: the common layout, planned from the block ids alone.

With one KV-cache group, one GPU block per CPU block (blocks_per_chunk 1) and the group's CPU
views back to back in the worker's cell, a job's block k is one run of region memory (its
cell) and page r of it sits at a fixed offset in that run. The staged backend then needs no
per-copy planning: its kernel table follows from the GPU ids by one broadcast, its DMA
descriptors from the CPU ids. That saves most of a job's CPU time, which bounds how many
small jobs one thread can issue (both directions at once on a 16-block job of 32 KiB pages
spent 93 % of its wall time issuing through the general planner; docs/transfer.md).

Anything this module does not recognise goes through the general planner, which also
produces every error message; this path never raises for a bad spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvshm.transfer.pointers import RowGeometry
from kvshm.transfer.specs import CanonicalKVCacheRef

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True)
class UniformLayout:
    """Per ref (in CPU address order): the GPU tensor's base and block stride, the page's
    offset in the cell and its size; and the cell's base, stride and size."""

    gpu_base: Int64s
    gpu_stride: Int64s
    cell_offset: Int64s
    page: Int64s
    cpu_base: int
    cpu_stride: int
    block_bytes: int
    gpu_rows: int
    cpu_rows: int

    @classmethod
    def of(
        cls,
        gpu: Sequence[RowGeometry],
        cpu: Sequence[RowGeometry],
        block_size_factor: int,
        group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    ) -> UniformLayout | None:
        """The layout, or None where a job of it is not one run per block."""
        if block_size_factor != 1 or len(group_refs) != 1 or not group_refs[0]:
            return None
        refs = sorted(group_refs[0], key=lambda r: cpu[r.tensor_idx].base)
        views = [cpu[r.tensor_idx] for r in refs]
        first = views[0]
        end = first.base
        for ref, view in zip(refs, views, strict=True):
            # back to back, each page filling its view's row, every row the cell's stride
            if view.base != end or view.row_width != ref.page_size_bytes:
                return None
            if view.row_stride != first.row_stride:
                return None
            end += view.row_width
        gpus = [gpu[r.tensor_idx] for r in refs]
        if any(g.row_width < r.page_size_bytes for g, r in zip(gpus, refs, strict=True)):
            return None
        return cls(
            gpu_base=np.array([g.base for g in gpus], dtype=np.int64),
            gpu_stride=np.array([g.row_stride for g in gpus], dtype=np.int64),
            cell_offset=np.array([v.base - first.base for v in views], dtype=np.int64),
            page=np.array([r.page_size_bytes for r in refs], dtype=np.int64),
            cpu_base=first.base,
            cpu_stride=first.row_stride,
            block_bytes=end - first.base,
            gpu_rows=min(g.num_rows for g in gpus),
            cpu_rows=min(v.num_rows for v in views),
        )

    @property
    def refs(self) -> int:
        return len(self.page)

    @property
    def largest_page(self) -> int:
        return int(self.page.max())

    @property
    def mean_page_bytes(self) -> int:
        return self.block_bytes // self.refs

    def job(self, spec: object, gpu_to_cpu: bool) -> UniformJob | None:
        """The job's ids if the spec is a valid uniform job, else None (the general planner
        then validates it and says what is wrong)."""
        if not isinstance(spec, tuple) or len(spec) != 2:
            return None
        gpu, cpu = spec if gpu_to_cpu else spec[::-1]
        try:
            sizes, indices = gpu.group_sizes, gpu.block_indices
            gpu_ids, cpu_ids = np.asarray(gpu.block_ids), np.asarray(cpu.block_ids)
        except AttributeError:
            return None
        if hasattr(cpu, "group_sizes") or len(sizes) != 1 or len(indices) != 1:
            return None
        count = len(gpu_ids)
        if gpu_ids.ndim != 1 or cpu_ids.shape != (count,) or sizes[0] != count or count == 0:
            return None
        if indices[0] < 0 or gpu_ids.dtype.kind not in "iu" or cpu_ids.dtype.kind not in "iu":
            return None
        gpu_ids = gpu_ids.astype(np.int64, copy=False)
        cpu_ids = cpu_ids.astype(np.int64, copy=False)
        if gpu_ids.min() < 0 or gpu_ids.max() >= self.gpu_rows:
            return None
        if cpu_ids.min() < 0 or cpu_ids.max() >= self.cpu_rows:
            return None
        return UniformJob(gpu_ids, cpu_ids, count * self.block_bytes)


@dataclass(frozen=True)
class UniformJob:
    gpu_ids: Int64s
    cpu_ids: Int64s
    total_bytes: int


@dataclass(frozen=True)
class UniformPieces:
    """How a uniform job of `count` blocks is cut into pieces, whatever its ids: piece p takes
    blocks p*blocks_per_piece.. into its buffer, block k of a piece at k*block_bytes and page
    r of it at cell_offset[r] (the cell's own layout, so one DMA descriptor moves the block).
    The staged backend keeps these per block count, so a job computes only what its ids
    change."""

    piece: Int64s
    """Per block: its piece."""
    block_offset: Int64s
    """Per block: its offset in its piece's buffer."""
    page_offset: Int64s
    """(blocks, refs): each page's offset in its piece's buffer."""
    sizes: Int64s
    """(blocks x refs): the kernel table's size row."""
    run_starts: Int64s
    """Index of each piece's first block, and the block count at the end."""
    copy_starts: Int64s
    """Index of each piece's first page, and the page count at the end."""


def uniform_pieces(layout: UniformLayout, count: int, blocks_per_piece: int) -> UniformPieces:
    piece, slot = np.divmod(np.arange(count, dtype=np.int64), blocks_per_piece)
    block_offset = slot * layout.block_bytes
    run_starts = np.append(np.arange(0, count, blocks_per_piece, dtype=np.int64), count)
    return UniformPieces(
        piece=piece,
        block_offset=block_offset,
        page_offset=block_offset[:, None] + layout.cell_offset[None, :],
        sizes=np.tile(layout.page, count),
        run_starts=run_starts,
        copy_starts=run_starts * layout.refs,
    )


@dataclass(frozen=True)
class UniformTables:
    """What the staged backend issues for a uniform job: the kernel's (3, blocks x refs) copy
    table between the GPU pages and the pieces' buffers, the DMA's (3, blocks) run table
    between the buffers and the cells, and where each piece starts in both."""

    kernel: Int64s
    runs: Int64s
    copy_piece_starts: Int64s
    run_piece_starts: Int64s
    largest_copy: int


def uniform_tables(
    layout: UniformLayout,
    job: UniformJob,
    bases: Int64s,
    pieces: UniformPieces,
    gpu_to_cpu: bool,
    kernel_out: Int64s | None = None,
) -> UniformTables:
    """The job's tables, piece p's buffer at bases[p] (pieces: uniform_pieces for the job's
    block count). kernel_out: where to write the kernel table (e.g. a pinned buffer), shape
    (3, blocks x refs)."""
    count, refs = len(job.gpu_ids), layout.refs
    kernel = np.empty((3, count * refs), dtype=np.int64) if kernel_out is None else kernel_out
    gpu_pages = kernel[0 if gpu_to_cpu else 1].reshape(count, refs)
    staged_pages = kernel[1 if gpu_to_cpu else 0].reshape(count, refs)
    np.multiply(job.gpu_ids[:, None], layout.gpu_stride[None, :], out=gpu_pages)
    gpu_pages += layout.gpu_base
    piece_base = bases[pieces.piece]
    np.add(pieces.page_offset, piece_base[:, None], out=staged_pages)
    kernel[2] = pieces.sizes
    runs = np.empty((3, count), dtype=np.int64)
    staged, cells = (runs[0], runs[1]) if gpu_to_cpu else (runs[1], runs[0])
    np.add(pieces.block_offset, piece_base, out=staged)
    np.multiply(job.cpu_ids, layout.cpu_stride, out=cells)
    cells += layout.cpu_base
    runs[2] = layout.block_bytes
    return UniformTables(
        kernel=kernel,
        runs=runs,
        copy_piece_starts=pieces.copy_starts,
        run_piece_starts=pieces.run_starts,
        largest_copy=layout.largest_page,
    )
