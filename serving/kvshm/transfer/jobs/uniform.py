"""Uniform jobs: the common layout, planned from the block ids alone.

With one KV-cache group, one GPU block per CPU block (blocks_per_chunk 1) and the group's CPU
views back to back in the worker's cell, a job's block k is one run of region memory (its
cell) and page r of it sits at a fixed offset in that run. The staged backend then needs no
per-copy planning: its kernel table follows from the GPU ids by one broadcast, its DMA
descriptors from the CPU ids. That saves most of a job's CPU time, which bounds how many
small jobs one thread can issue (docs/transfer.md).

Anything this module does not recognise goes through the general planner, which also
produces every error message; this path never raises for a bad spec.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef

Int64s = npt.NDArray[np.int64]
MAX_PITCH = (1 << 31) - 1  # the largest row pitch a 2-D copy takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH)


def row_pitch(addresses: Sequence[int], row_bytes: int) -> int | None:
    """The one step between consecutive addresses, where it holds a row of row_bytes and a 2-D
    copy takes it (at most MAX_PITCH); else None (fewer than two addresses too)."""
    steps = {b - a for a, b in itertools.pairwise(addresses)}
    if len(steps) != 1:
        return None
    (pitch,) = steps
    return pitch if row_bytes <= pitch <= MAX_PITCH else None


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

    def layer_pitch(self) -> int | None:
        """The bytes between consecutive pages of a block on the GPU where they lie at one
        stride and back to back in the cell, so that one 2-D copy moves a block (vLLM 0.33's
        layer-outer KV cache: one allocation, layer l of block b at l * layer_stride + b *
        page); else None."""
        page, refs = int(self.page[0]), self.refs
        if refs < 2 or np.any(self.page != page) or np.any(self.gpu_stride != self.gpu_stride[0]):
            return None
        if np.any(self.cell_offset != np.arange(refs, dtype=np.int64) * page):
            return None
        return row_pitch(self.gpu_base.tolist(), page)

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
class UniformCut:
    """What a uniform job of `count` blocks issues that its ids do not change, for the
    buffers it goes through: piece p takes blocks run_starts[p].. into the buffer at bases[p],
    block k of a piece at k*block_bytes and page r of it at cell_offset[r] (the cell's own
    layout, so one DMA descriptor moves the block). The staged backend keeps these per block
    count and buffers, so a job computes only its GPU pages' and its cells' addresses."""

    staged_pages: Int64s
    """(blocks x refs): each page's address in the buffers (the kernel table's staged row)."""
    sizes: Int64s
    """(blocks x refs): the kernel table's size row."""
    staged_cells: Int64s
    """Per block: its address in the buffers (the DMA table's staged row)."""
    block_bytes: int
    run_starts: Int64s
    """Index of each piece's first block, and the block count at the end."""
    copy_starts: Int64s
    """Index of each piece's first page, and the page count at the end."""
    largest_copy: int

    @property
    def blocks(self) -> int:
        return len(self.staged_cells)

    def new_runs(self, gpu_to_cpu: bool) -> Int64s:
        """A (3, blocks) DMA table with this cut's staged and size rows: uniform_tables
        writes only its cells row, so one serves every job of the cut (the driver reads
        descriptors during the call that issues them)."""
        runs = np.empty((3, self.blocks), dtype=np.int64)
        runs[0 if gpu_to_cpu else 1] = self.staged_cells
        runs[2] = self.block_bytes
        return runs


def uniform_cut(
    layout: UniformLayout, count: int, bases: Int64s, blocks_per_piece: int
) -> UniformCut:
    """The cut of a `count`-block job whose pieces go to the buffers at `bases`."""
    piece, slot = np.divmod(np.arange(count, dtype=np.int64), blocks_per_piece)
    if len(bases) <= piece[-1]:
        raise ValueError(f"{count} blocks take {piece[-1] + 1} buffers, {len(bases)} given")
    staged_cells = bases[piece] + slot * layout.block_bytes
    run_starts = np.append(np.arange(0, count, blocks_per_piece, dtype=np.int64), count)
    return UniformCut(
        staged_pages=(staged_cells[:, None] + layout.cell_offset[None, :]).ravel(),
        sizes=np.tile(layout.page, count),
        staged_cells=staged_cells,
        block_bytes=layout.block_bytes,
        run_starts=run_starts,
        copy_starts=run_starts * layout.refs,
        largest_copy=layout.largest_page,
    )


def uniform_tables(
    layout: UniformLayout,
    job: UniformJob,
    cut: UniformCut,
    gpu_to_cpu: bool,
    kernel_out: Int64s | None = None,
    runs_out: Int64s | None = None,
) -> tuple[Int64s, Int64s]:
    """The job's kernel table, (3, blocks x refs) copies between the GPU pages and the
    buffers, and DMA table (uniform_runs). kernel_out: where to write the kernel table (e.g.
    a pinned buffer); the page kernel needs none (it addresses the pages from the ids)."""
    count, refs = cut.blocks, layout.refs
    if len(job.gpu_ids) != count:
        raise ValueError(f"a job of {len(job.gpu_ids)} blocks given a cut of {count}")
    kernel = np.empty((3, count * refs), dtype=np.int64) if kernel_out is None else kernel_out
    gpu_row, staged_row = (0, 1) if gpu_to_cpu else (1, 0)
    gpu_pages = kernel[gpu_row].reshape(count, refs)
    np.multiply(job.gpu_ids[:, None], layout.gpu_stride[None, :], out=gpu_pages)
    gpu_pages += layout.gpu_base
    kernel[staged_row] = cut.staged_pages
    kernel[2] = cut.sizes
    return kernel, uniform_runs(layout, job, cut, gpu_to_cpu, runs_out)


def uniform_runs(
    layout: UniformLayout,
    job: UniformJob,
    cut: UniformCut,
    gpu_to_cpu: bool,
    runs_out: Int64s | None = None,
) -> Int64s:
    """The job's DMA table, (3, blocks) runs between the buffers and the cells (cut: its
    uniform_cut). runs_out: a table from cut.new_runs, whose cells row is rewritten."""
    if len(job.cpu_ids) != cut.blocks:
        raise ValueError(f"a job of {len(job.cpu_ids)} blocks given a cut of {cut.blocks}")
    runs = cut.new_runs(gpu_to_cpu) if runs_out is None else runs_out
    cells = runs[1 if gpu_to_cpu else 0]
    np.multiply(job.cpu_ids, layout.cpu_stride, out=cells)
    cells += layout.cpu_base
    return runs


class UniformCopies:
    """A uniform job's copies for the copy engines, one per page, from its ids alone: the
    same table, in the same order, that the DMA backend issues for the general planner's
    copies of the job, without planning and sorting them, which cost a block-outer job a large
    share of its submitting where submitting bounds both directions at once (docs/transfer.md).

    by_gpu_address: tensor by tensor, each tensor's pages in ascending GPU address (the
    DMA backend's order from SORT_BELOW_BYTES; the same as sorting every copy by its GPU
    address where the tensors take disjoint ranges, as vLLM's caches do); else block by block,
    each block's pages in cell order, blocks in ascending cell for stores (host memory takes
    writes in address order) and in the job's order for loads."""

    def __init__(self, layout: UniformLayout, gpu_to_cpu: bool, by_gpu_address: bool) -> None:
        self._gpu_to_cpu = gpu_to_cpu
        self._by_gpu = by_gpu_address
        refs = np.argsort(layout.gpu_base, kind="stable") if by_gpu_address else slice(None)
        self._gpu_base = layout.gpu_base[refs]
        self._gpu_stride = layout.gpu_stride[refs]
        self._cell_offset = layout.cell_offset[refs]
        self._page = layout.page[refs]
        self._cpu_base, self._cpu_stride = layout.cpu_base, layout.cpu_stride
        self.refs = layout.refs

    def batch(self, job: UniformJob) -> CopyBatch:
        gpu_ids, cpu_ids = job.gpu_ids, job.cpu_ids
        order = None
        if self._by_gpu:
            order = np.argsort(gpu_ids, kind="stable")
        elif self._gpu_to_cpu:
            order = np.argsort(cpu_ids, kind="stable")
        if order is not None:
            gpu_ids, cpu_ids = gpu_ids[order], cpu_ids[order]
        cells = cpu_ids * self._cpu_stride
        cells += self._cpu_base
        batch = CopyBatch.allocate(len(gpu_ids) * self.refs)
        # (refs, blocks) tensor by tensor, or (blocks, refs) block by block
        shape = (3, self.refs, len(gpu_ids)) if self._by_gpu else (3, len(gpu_ids), self.refs)
        rows = batch.rows.reshape(shape)
        column: tuple[slice | None, ...]
        if self._by_gpu:
            column, ids, cell_ids = (slice(None), None), gpu_ids[None, :], cells[None, :]
        else:
            column, ids, cell_ids = (None, slice(None)), gpu_ids[:, None], cells[:, None]
        gpu_row, cpu_row = (0, 1) if self._gpu_to_cpu else (1, 0)
        np.multiply(self._gpu_stride[column], ids, out=rows[gpu_row])
        rows[gpu_row] += self._gpu_base[column]
        np.add(self._cell_offset[column], cell_ids, out=rows[cpu_row])
        rows[2] = self._page[column]
        return batch.with_total(job.total_bytes)
