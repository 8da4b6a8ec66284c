"""The staged copy's plan: runs of contiguous host memory, pieces that fit a buffer, and the
tables that move every byte where a direct copy would (emulated with memmove, no GPU)."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from kvshm.transfer import (
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SingleDirectionOffloadingHandler,
)
from kvshm.transfer.backends.staged import staged_tables
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.staging import StagingPlan, layout_run_bytes, plan_staging

from .helpers import open_region, region_bytes, unpadded

PAGE = 1024
TENSORS = 4
WORKERS = 2
ROWS = 64
CELL = TENSORS * PAGE
ROW = CELL * WORKERS


def cell_copies(blocks: list[int], base: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Host addresses and sizes of a job moving every tensor's page of `blocks` for worker 0,
    in the planner's order (block by block, each block's pages in address order)."""
    host = [base + b * ROW + t * PAGE for b in blocks for t in range(TENSORS)]
    return np.array(host, dtype=np.int64), np.full(len(host), PAGE, dtype=np.int64)


def check_plan(plan: StagingPlan, host: np.ndarray, sizes: np.ndarray, piece_bytes: int) -> None:
    """Every copy once, in order; pieces fit; runs are contiguous, maximal and hold exactly
    their copies at the right offsets."""
    starts = plan.copy_piece_starts
    assert starts[0] == 0 and starts[-1] == len(host) and np.all(np.diff(starts) > 0)
    for p in range(plan.pieces):
        copies = np.arange(starts[p], starts[p + 1])
        offsets = plan.offsets[starts[p] : starts[p + 1]]
        assert offsets[0] == 0 and int(sizes[copies].sum()) <= piece_bytes
        assert np.array_equal(offsets[1:], offsets[:-1] + sizes[copies][:-1])  # packed
        runs = range(plan.run_piece_starts[p], plan.run_piece_starts[p + 1])
        assert sum(int(plan.run_bytes[r]) for r in runs) == int(sizes[copies].sum())
        for r in runs:
            inside = (offsets >= plan.run_offsets[r]) & (
                offsets < plan.run_offsets[r] + plan.run_bytes[r]
            )
            # a copy at offset o of the buffer comes from host run_host + (o - run_offset)
            expected = plan.run_host[r] + offsets[inside] - plan.run_offsets[r]
            assert np.array_equal(host[copies[inside]], expected)
        for a, b in itertools.pairwise(runs):
            assert plan.run_host[a] + plan.run_bytes[a] != plan.run_host[b]  # maximal


def test_one_run_per_block_holds_all_of_its_tensors_pages() -> None:
    blocks = [3, 17, 9, 40, 22]
    host, sizes = cell_copies(blocks)
    plan = plan_staging(host, sizes, 8 * CELL)
    check_plan(plan, host, sizes, 8 * CELL)
    assert plan.runs == len(blocks) and plan.pieces == 1
    assert plan.mean_run_bytes == CELL
    assert sorted(plan.run_host.tolist()) == sorted(1 << 20 | b * ROW for b in blocks)


def test_consecutive_blocks_of_one_worker_do_not_join_across_other_workers_cells() -> None:
    host, sizes = cell_copies([5, 6, 7])
    plan = plan_staging(host, sizes, 8 * CELL)
    assert plan.runs == 3  # worker 1's cell lies between worker 0's cells of blocks 5 and 6


def test_copies_contiguous_across_rows_form_one_run_in_order_only() -> None:
    host = np.arange(10, dtype=np.int64) * PAGE + 4096
    sizes = np.full(10, PAGE, dtype=np.int64)
    plan = plan_staging(host, sizes, 16 * PAGE)
    check_plan(plan, host, sizes, 16 * PAGE)
    assert plan.runs == 1 and plan.run_bytes[0] == 10 * PAGE
    backwards = plan_staging(host[::-1].copy(), sizes, 16 * PAGE)
    check_plan(backwards, host[::-1], sizes, 16 * PAGE)
    assert backwards.runs == 10  # runs follow the job's order; nothing is sorted


def test_pieces_split_runs_at_buffer_boundaries() -> None:
    host, sizes = cell_copies(list(range(0, 40, 2)))
    piece_bytes = 3 * PAGE  # smaller than a cell: every cell is cut
    plan = plan_staging(host, sizes, piece_bytes)
    check_plan(plan, host, sizes, piece_bytes)
    assert plan.pieces == -(-len(host) // 3)
    assert plan.runs > 20


@pytest.mark.parametrize("seed", range(5))
def test_random_mixed_sizes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.choice([16, 32, 64, 256], size=200).astype(np.int64)
    footprint = sizes + np.where(rng.random(200) < 0.3, 16, 0)  # gaps break some runs
    host = 1024 + np.cumsum(footprint) - footprint
    piece_bytes = int(rng.choice([256, 1024, 4096]))
    plan = plan_staging(host, sizes, piece_bytes)
    check_plan(plan, host, sizes, piece_bytes)
    shuffled = rng.permutation(200)
    check_plan(
        plan_staging(host[shuffled], sizes[shuffled], piece_bytes),
        host[shuffled],
        sizes[shuffled],
        piece_bytes,
    )


def test_a_copy_larger_than_a_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="a copy of 2048 bytes does not fit a 1024-byte buffer"):
        plan_staging(np.array([0], dtype=np.int64), np.array([2048], dtype=np.int64), 1024)


def test_an_empty_job_has_no_pieces_and_no_runs() -> None:
    empty = np.empty(0, dtype=np.int64)
    plan = plan_staging(empty, empty, 1024)
    assert (plan.pieces, plan.runs, plan.copies, plan.mean_run_bytes) == (0, 0, 0, 0)


def test_layout_runs_join_views_that_lie_back_to_back_in_the_cell() -> None:
    def view(offset: int, width: int) -> RowGeometry:
        return RowGeometry(base=4096 + offset, row_stride=ROW, row_width=width, num_rows=ROWS)

    cpu = [view(0, PAGE), view(PAGE, PAGE), view(2 * PAGE, PAGE), view(3 * PAGE + 64, 512)]
    refs = [CanonicalKVCacheRef(i, PAGE) for i in range(3)]
    assert layout_run_bytes(cpu, [refs]) == 3 * PAGE
    assert layout_run_bytes(cpu, [refs[::-1]]) == 3 * PAGE  # the order of refs does not matter
    assert layout_run_bytes(cpu, [[refs[0], refs[2]]]) == PAGE  # a gap between them
    gap = [[CanonicalKVCacheRef(2, PAGE), CanonicalKVCacheRef(3, 512)]]
    assert layout_run_bytes(cpu, gap) == PAGE  # 64 bytes of slack break the run
    assert layout_run_bytes(cpu, [[refs[0]], refs[1:]]) == 2 * PAGE  # the longest group's
    assert layout_run_bytes(cpu, []) == 0


# -- the tables, applied with memmove --------------------------------------------------------


def apply(rows: np.ndarray) -> None:
    for src, dst, size in zip(*rows.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


@pytest.fixture
def handlers(tmp_path: object) -> Iterator[dict[bool, SingleDirectionOffloadingHandler]]:
    import torch

    region = open_region(str(tmp_path), unpadded(ROWS, CELL, WORKERS), 0)
    views = [region.create_next_view(PAGE) for _ in range(TENSORS)]
    gpu = [torch.randint(-128, 128, (ROWS, PAGE), dtype=torch.int8) for _ in range(TENSORS)]
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(TENSORS)]]
    out = {d: SingleDirectionOffloadingHandler(gpu, views, 1, refs, d) for d in (True, False)}
    region_bytes(region)[:] = np.random.default_rng(1).integers(0, 256, (ROWS, ROW))
    yield out
    for handler in out.values():
        handler.shutdown()
    del views
    region.cleanup()


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("piece_cells", [1, 3, 64])
def test_staged_tables_move_every_byte_a_direct_copy_moves(
    handlers: dict[bool, SingleDirectionOffloadingHandler], gpu_to_cpu: bool, piece_cells: int
) -> None:
    handler = handlers[gpu_to_cpu]
    rng = np.random.default_rng(piece_cells)
    gpu_ids, cpu_ids = rng.permutation(ROWS)[:20], rng.permutation(ROWS)[:20]
    gpu_spec = GPULoadStoreSpec(gpu_ids, [20], [0])
    spec = (gpu_spec, CPULoadStoreSpec(cpu_ids))
    batch: CopyBatch = handler._planner.plan(spec if gpu_to_cpu else spec[::-1])
    target = handler.cpu_tensors if gpu_to_cpu else handler.gpu_tensors
    before = [t.clone() for t in target]

    apply(batch.rows)
    direct = [t.clone() for t in target]
    for tensor, saved in zip(target, before, strict=True):
        tensor.copy_(saved)
    assert any(not a.equal(b) for a, b in zip(direct, before, strict=True))

    plan = plan_staging(batch.dst if gpu_to_cpu else batch.src, batch.sizes, piece_cells * CELL)
    assert plan.runs == 20  # one run per block: a cell is never cut, nor joined to another
    buffers = [np.zeros(piece_cells * CELL, dtype=np.uint8) for _ in range(plan.pieces)]
    bases = np.array([b.ctypes.data for b in buffers], dtype=np.int64)
    # wider than the job, as a lent table is: the columns past the job's copies are not its
    kernel_rows = np.full((3, plan.copies + 5), -1, dtype=np.int64)
    runs = staged_tables(batch, plan, bases, gpu_to_cpu, kernel_rows)
    assert (kernel_rows[:, plan.copies :] == -1).all()
    kernel_table = kernel_rows[:, : plan.copies]
    if gpu_to_cpu:  # gather into the buffers, then the runs out to the region
        apply(kernel_table)
        apply(runs.rows)
    else:  # the runs into the buffers, then scatter
        apply(runs.rows)
        apply(kernel_table)
    for staged, expected in zip(target, direct, strict=True):
        assert staged.equal(expected)


def test_a_layout_is_staged_only_with_long_runs_of_small_pages() -> None:
    from kvshm.transfer import BackendPolicy
    from kvshm.transfer.choice.chooser import why_not_staged

    def views(page: int, count: int) -> list[RowGeometry]:
        return [RowGeometry(4096 + t * page, ROW, page, ROWS) for t in range(count)]

    policy = BackendPolicy()
    layers = [[CanonicalKVCacheRef(t, 16 * 1024) for t in range(32)]]
    assert why_not_staged(views(16 * 1024, 32), layers, policy) is None
    two = [[CanonicalKVCacheRef(t, 16 * 1024) for t in range(2)]]
    assert "runs of at most 32768 bytes" in str(why_not_staged(views(16 * 1024, 2), two, policy))
    large = [[CanonicalKVCacheRef(t, 128 * 1024) for t in range(32)]]
    assert "reach the link by DMA" in str(why_not_staged(views(128 * 1024, 32), large, policy))
