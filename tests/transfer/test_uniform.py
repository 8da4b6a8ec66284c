"""Uniform jobs (kvshm.transfer.jobs.uniform): which layouts qualify, which specs take the short
path (any other goes to the general planner, which names what is wrong), and tables that move
every byte where the general planner's direct copies would (memmove, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvshm.transfer import CanonicalKVCacheRef, CPULoadStoreSpec, GPULoadStoreSpec
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.backends.staged import CUTS_KEPT, StagedBackend, _Buffer
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.uniform import UniformLayout, uniform_cut, uniform_tables

from .helpers import GPU_ROWS, cpu_views, gpu_views, one_group
from .test_staging import CELL, PAGE, ROW, ROWS, TENSORS, apply, handlers  # noqa: F401


def test_back_to_back_pages_of_one_group_make_a_uniform_layout() -> None:
    pages = [PAGE, 2 * PAGE, PAGE]  # sizes may differ
    layout = UniformLayout.of(gpu_views(pages), cpu_views(pages, ROW), 1, one_group(pages))
    assert layout is not None
    assert layout.block_bytes == 4 * PAGE and layout.refs == 3
    assert layout.cell_offset.tolist() == [0, PAGE, 3 * PAGE]
    assert (layout.gpu_rows, layout.cpu_rows) == (GPU_ROWS, ROWS)
    # the refs' order does not matter: the cell's does
    shuffled = [[one_group(pages)[0][2], one_group(pages)[0][0], one_group(pages)[0][1]]]
    again = UniformLayout.of(gpu_views(pages), cpu_views(pages, ROW), 1, shuffled)
    assert again is not None and again.cell_offset.tolist() == [0, PAGE, 3 * PAGE]


def test_other_layouts_take_the_general_path() -> None:
    pages = [PAGE] * TENSORS
    gpu, cpu = gpu_views(pages), cpu_views(pages, ROW)
    assert UniformLayout.of(gpu, cpu, 2, one_group(pages)) is None  # two blocks per chunk
    two_groups = [one_group(pages)[0][:2], one_group(pages)[0][2:]]
    assert UniformLayout.of(gpu, cpu, 1, two_groups) is None
    gap = cpu[:2] + [RowGeometry(c.base + 64, c.row_stride, c.row_width, ROWS) for c in cpu[2:]]
    assert UniformLayout.of(gpu, gap, 1, one_group(pages)) is None  # not back to back
    strides = [*cpu[:3], RowGeometry(cpu[3].base, 2 * ROW, PAGE, ROWS)]
    assert UniformLayout.of(gpu, strides, 1, one_group(pages)) is None
    half = [[CanonicalKVCacheRef(t, PAGE // 2) for t in range(TENSORS)]]
    assert UniformLayout.of(gpu, cpu, 1, half) is None  # pages narrower than their views
    assert UniformLayout.of(gpu, cpu, 1, [[]]) is None


@pytest.fixture
def layout() -> UniformLayout:
    pages = [PAGE] * TENSORS
    made = UniformLayout.of(gpu_views(pages), cpu_views(pages, ROW), 1, one_group(pages))
    assert made is not None
    return made


def test_a_valid_job_is_read_both_ways(layout: UniformLayout) -> None:
    gpu = GPULoadStoreSpec([3, 1, 2], [3], [5])
    cpu = CPULoadStoreSpec([7, 0, 63])
    for spec, gpu_to_cpu in (((gpu, cpu), True), ((cpu, gpu), False)):
        job = layout.job(spec, gpu_to_cpu)
        assert job is not None
        assert job.gpu_ids.tolist() == [3, 1, 2] and job.cpu_ids.tolist() == [7, 0, 63]
        assert job.total_bytes == 3 * CELL


@pytest.mark.parametrize(
    "spec",
    [
        (GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([1])),  # one CPU id short
        (GPULoadStoreSpec([1, 2], [1], [0]), CPULoadStoreSpec([1, 2])),  # group size
        (GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), CPULoadStoreSpec([1, 2])),  # two groups
        (GPULoadStoreSpec([1, GPU_ROWS], [2], [0]), CPULoadStoreSpec([1, 2])),  # GPU range
        (GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([1, ROWS])),  # CPU range
        (GPULoadStoreSpec([1, 2], [2], [-1]), CPULoadStoreSpec([1, 2])),
        (GPULoadStoreSpec([], [0], [0]), CPULoadStoreSpec([])),  # nothing to move
        (CPULoadStoreSpec([1]), GPULoadStoreSpec([1], [1], [0])),  # sides swapped
        (GPULoadStoreSpec([1], [1], [0]), GPULoadStoreSpec([1], [1], [0])),
        "not a pair",
    ],
)
def test_anything_else_goes_to_the_general_planner(layout: UniformLayout, spec: Any) -> None:
    assert layout.job(spec, True) is None


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("blocks_per_piece", [1, 3, 64])
def test_uniform_tables_move_every_byte_the_general_planner_moves(
    handlers: dict[bool, Any],  # noqa: F811
    gpu_to_cpu: bool,
    blocks_per_piece: int,
) -> None:
    handler = handlers[gpu_to_cpu]
    gpu = [RowGeometry.of(t) for t in handler.gpu_tensors]
    cpu = [RowGeometry.of(t) for t in handler.cpu_tensors]
    layout = UniformLayout.of(gpu, cpu, 1, handler.kv_cache_groups_data_refs)
    assert layout is not None
    rng = np.random.default_rng(blocks_per_piece)
    gpu_ids, cpu_ids = rng.permutation(ROWS)[:20], rng.permutation(ROWS)[:20]
    pair = (GPULoadStoreSpec(gpu_ids, [20], [0]), CPULoadStoreSpec(cpu_ids))
    spec: tuple[Any, Any] = pair if gpu_to_cpu else pair[::-1]
    target = handler.cpu_tensors if gpu_to_cpu else handler.gpu_tensors
    before = [t.clone() for t in target]
    apply(handler._planner.plan(spec).rows)  # the general planner's direct copies
    direct = [t.clone() for t in target]
    for tensor, saved in zip(target, before, strict=True):
        tensor.copy_(saved)
    assert any(not a.equal(b) for a, b in zip(direct, before, strict=True))

    job = layout.job(spec, gpu_to_cpu)
    assert job is not None
    piece_count = -(-20 // blocks_per_piece)
    buffers = [np.zeros(blocks_per_piece * CELL, dtype=np.uint8) for _ in range(piece_count)]
    bases = np.array([b.ctypes.data for b in buffers], dtype=np.int64)
    cut = uniform_cut(layout, 20, bases, blocks_per_piece)
    kernel, runs = uniform_tables(layout, job, cut, gpu_to_cpu)
    assert runs.shape == (3, 20) and set(runs[2].tolist()) == {CELL}
    assert cut.run_starts.tolist()[-1] == 20
    assert cut.copy_starts.tolist() == (cut.run_starts * TENSORS).tolist()
    # the same again into a wider (pooled) table and the cut's kept DMA table
    wide, kept_runs = np.full((3, 20 * TENSORS + 7), -1, dtype=np.int64), cut.new_runs(gpu_to_cpu)
    uniform_tables(layout, job, cut, gpu_to_cpu, wide[:, : 20 * TENSORS], kept_runs)
    assert np.array_equal(wide[:, : 20 * TENSORS], kernel) and np.all(wide[:, 20 * TENSORS :] == -1)
    assert np.array_equal(kept_runs, runs)
    tables = SimpleNamespace(kernel=kernel, runs=runs)
    if gpu_to_cpu:  # gather into the buffers, then the cells out to the region
        apply(tables.kernel)
        apply(tables.runs)
    else:  # the cells into the buffers, then scatter
        apply(tables.runs)
        apply(tables.kernel)
    for staged, expected in zip(target, direct, strict=True):
        assert staged.equal(expected)


def test_the_staged_backend_keeps_a_bounded_cut_per_block_count_and_buffer() -> None:
    pages = [PAGE] * TENSORS
    layout = UniformLayout.of(gpu_views(pages), cpu_views(pages, ROW), 1, one_group(pages))
    assert layout is not None
    # the cut needs neither the GPU nor the copy backends: a ring of host buffers will do
    none = cast(Any, None)
    backend = StagedBackend(
        torch.device("cpu"), True, cast(DmaBackend, none), cast(KernelBackend, none), 4 * CELL, 3
    )
    backend._ring = [_Buffer(torch.empty(4 * CELL, dtype=torch.uint8), none, none) for _ in "abc"]
    bases = [b.memory.data_ptr() for b in backend._ring]
    first, runs = backend._cut_for(layout, 10, [1, 2, 0], 4)
    assert first.run_starts.tolist() == [0, 4, 8, 10]
    expected = [bases[b] + k * CELL for b in (1, 2, 0) for k in range(4)]
    assert first.staged_cells.tolist() == expected[:10]
    assert runs.total_bytes == 10 * CELL and runs.rows[2].tolist() == [CELL] * 10
    assert backend._cut_for(layout, 10, [1, 2, 0], 4)[0] is first  # kept
    assert backend._cut_for(layout, 10, [2, 0, 1], 4)[0] is not first  # other buffers
    for count in range(1, 2 * CUTS_KEPT):
        backend._cut_for(layout, count, [p % 3 for p in range(-(-count // 4))], 4)
    assert len(backend._cuts) == CUTS_KEPT
    assert backend._cut_for(layout, 10, [1, 2, 0], 4)[0] is not first  # pushed out, cut again
    elsewhere = cpu_views(pages, ROW, base=1 << 31)
    other = UniformLayout.of(gpu_views(pages), elsewhere, 1, one_group(pages))
    assert other is not None
    assert backend._cut_for(other, 10, [1, 2, 0], 4)[0] is not first


def test_a_cut_refuses_too_few_buffers_and_a_job_of_another_size(layout: UniformLayout) -> None:
    with pytest.raises(ValueError, match="take 3 buffers, 2 given"):
        uniform_cut(layout, 10, np.array([0, 1 << 20], dtype=np.int64), 4)
    cut = uniform_cut(layout, 4, np.array([0], dtype=np.int64), 4)
    job = layout.job((GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([3, 4])), True)
    assert job is not None
    with pytest.raises(ValueError, match="a job of 2 blocks given a cut of 4"):
        uniform_tables(layout, job, cut, True)
