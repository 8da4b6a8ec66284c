"""The handler's contract on the CPU backend: placement, order, results, wait and shutdown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from kvshm.region import SharedOffloadRegion
from kvshm.transfer import (
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    HandlerAssembly,
    HandlerClosedError,
    HandlerLayout,
    SingleDirectionOffloadingHandler,
    TransferResult,
    WorkerHandlers,
)
from kvshm.transfer.backends.cpu import CpuMemmoveBackend
from kvshm.transfer.jobs.batch import CopyBatch

from .helpers import open_region, placements, region_bytes, unpadded

FACTOR = 4
GPU_PAGE = 64
NUM_GPU_BLOCKS = 40
NUM_CPU_BLOCKS = 24
CELL = 3 * GPU_PAGE * FACTOR + 32  # three tensors and some slack: row stride != row width
REFS = [
    [CanonicalKVCacheRef(0, GPU_PAGE), CanonicalKVCacheRef(1, GPU_PAGE)],
    [CanonicalKVCacheRef(2, 48)],  # a page smaller than the block: the rest stays untouched
    [CanonicalKVCacheRef(1, GPU_PAGE)],
]
# group 0 starts 3 positions into its first CPU block and ends mid-block, group 1 starts
# 1 in, group 2 moves nothing
GROUP_SIZES = [6, 5, 0]
BLOCK_INDICES = [3, 5, 2]
CPU_BLOCKS_USED = 3 + 2
POISON = 0x5A


@pytest.fixture
def region(tmp_path: object) -> Iterator[SharedOffloadRegion]:
    with open_region(str(tmp_path), unpadded(NUM_CPU_BLOCKS, CELL, 4), 2) as region:
        region_bytes(region)[:] = POISON
        yield region


@pytest.fixture
def handlers(region: SharedOffloadRegion) -> Iterator[WorkerHandlers]:
    """A worker's handlers as the plugin builds them, over rank 2's views of the region."""
    gpu = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, GPU_PAGE), dtype=torch.int8) for _ in range(3)]
    built = HandlerAssembly(HandlerLayout.over_region(gpu, region, FACTOR, REFS)).build()
    yield built
    built.shutdown()


def random_ids(rng: np.random.Generator, high: int, count: int) -> np.ndarray:
    return rng.choice(high, size=count, replace=False).astype(np.int64)


def store_spec(gpu_ids: np.ndarray, cpu_ids: np.ndarray) -> tuple[object, object]:
    return GPULoadStoreSpec(gpu_ids, GROUP_SIZES, BLOCK_INDICES), CPULoadStoreSpec(cpu_ids)


def finish(handler: object, job_ids: list[int]) -> list[TransferResult]:
    handler.wait(job_ids)  # type: ignore[attr-defined]
    return handler.get_finished()  # type: ignore[attr-defined, no-any-return]


def test_store_places_every_byte_and_nothing_else(
    handlers: WorkerHandlers, region: SharedOffloadRegion
) -> None:
    rng = np.random.default_rng(1)
    gpu_ids = random_ids(rng, NUM_GPU_BLOCKS, sum(GROUP_SIZES))
    cpu_ids = random_ids(rng, NUM_CPU_BLOCKS, CPU_BLOCKS_USED)
    expected = region_bytes(region).copy()
    cell_start = 2 * CELL  # rank 2
    for p in placements(gpu_ids, cpu_ids, GROUP_SIZES, BLOCK_INDICES, REFS, FACTOR):
        at = cell_start + p.tensor * GPU_PAGE * FACTOR + p.slot * GPU_PAGE
        source = handlers.store.gpu_tensors[p.tensor][p.gpu_id, : p.size].numpy().view(np.uint8)
        expected[p.cpu_id, at : at + p.size] = source

    assert handlers.store.transfer_async(7, store_spec(gpu_ids, cpu_ids))
    [result] = finish(handlers.store, [7])

    assert result == TransferResult(
        7, True, 6 * 64 * 2 + 5 * 48, result.transfer_time, ("GPU", "CPU")
    )
    assert result.transfer_time is not None and result.transfer_time >= 0
    np.testing.assert_array_equal(region_bytes(region), expected)


def test_load_brings_back_what_was_stored(handlers: WorkerHandlers) -> None:
    rng = np.random.default_rng(2)
    cpu_ids = random_ids(rng, NUM_CPU_BLOCKS, CPU_BLOCKS_USED)
    stored_from = random_ids(rng, NUM_GPU_BLOCKS, sum(GROUP_SIZES))
    assert handlers.store.transfer_async(1, store_spec(stored_from, cpu_ids))
    finish(handlers.store, [1])
    originals = [t.clone() for t in handlers.store.gpu_tensors]
    for tensor in handlers.store.gpu_tensors:
        tensor.fill_(0x33)

    load_to = random_ids(rng, NUM_GPU_BLOCKS, sum(GROUP_SIZES))
    spec = (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(load_to, GROUP_SIZES, BLOCK_INDICES))
    assert handlers.load.transfer_async(2, spec)
    [result] = finish(handlers.load, [2])

    assert result.success and result.transfer_type == ("CPU", "GPU")
    expected = [torch.full_like(t, 0x33) for t in originals]
    moves = zip(
        placements(stored_from, cpu_ids, GROUP_SIZES, BLOCK_INDICES, REFS, FACTOR),
        placements(load_to, cpu_ids, GROUP_SIZES, BLOCK_INDICES, REFS, FACTOR),
        strict=True,
    )
    for stored, loaded in moves:
        source = originals[stored.tensor][stored.gpu_id, : stored.size]
        expected[loaded.tensor][loaded.gpu_id, : loaded.size] = source
    for got, want in zip(handlers.store.gpu_tensors, expected, strict=True):
        assert torch.equal(got, want)


def test_other_workers_cells_are_never_touched(tmp_path: object) -> None:
    """Four ranks attach one region and store their own data: the rows interleave exactly."""
    ranks = [
        open_region(str(tmp_path), unpadded(8, 2 * 32, 4), r, instance_id="shared")
        for r in range(4)
    ]
    try:
        refs = [[CanonicalKVCacheRef(0, 32), CanonicalKVCacheRef(1, 32)]]
        data = {}
        for region in ranks:
            gpu = [torch.randint(-128, 128, (8, 32), dtype=torch.int8) for _ in range(2)]
            data[region.rank] = gpu
            handlers = HandlerAssembly(HandlerLayout.over_region(gpu, region, 1, refs)).build()
            ids = np.arange(8)
            handlers.store.transfer_async(
                0, (GPULoadStoreSpec(ids, [8], [0]), CPULoadStoreSpec(ids))
            )
            handlers.shutdown()
        rows = region_bytes(ranks[0])
        for rank, (k, v) in data.items():
            cell = rows[:, rank * 64 : (rank + 1) * 64]
            np.testing.assert_array_equal(cell[:, :32], k.numpy().view(np.uint8))
            np.testing.assert_array_equal(cell[:, 32:], v.numpy().view(np.uint8))
    finally:
        for region in reversed(ranks):
            region.cleanup()


class Gate:
    """Holds every CPU copy (or those `holds` picks) until opened, so tests can look at jobs
    in flight."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        holds: Callable[[CopyBatch], bool] = lambda batch: True,
    ) -> None:
        self.opened = threading.Event()
        self.started: list[int] = []
        original = CpuMemmoveBackend.copy

        def gated(
            backend: CpuMemmoveBackend, batch: CopyBatch, stream: object, after: object = None
        ) -> None:
            self.started.append(batch.count)
            if holds(batch):
                self.opened.wait(timeout=30)
            original(backend, batch, stream)

        monkeypatch.setattr(CpuMemmoveBackend, "copy", gated)


def one_block_spec(gpu_id: int, cpu_id: int) -> tuple[object, object]:
    return (
        GPULoadStoreSpec([gpu_id], [1, 0, 0], [0, 0, 0]),
        CPULoadStoreSpec([cpu_id]),
    )


def test_jobs_finish_in_submission_order(
    handlers: WorkerHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    handler = handlers.store
    for job_id in (30, 10, 20):
        assert handler.transfer_async(job_id, one_block_spec(job_id // 10, job_id // 10))
    assert handler.get_finished() == []

    gate.opened.set()
    handler.wait(iter([10, 30]))  # any iterable, in any order: both are done after it
    results = handler.get_finished()
    assert [r.job_id for r in results][:2] == [30, 10]
    handler.wait({20})
    results += handler.get_finished()

    assert [r.job_id for r in results] == [30, 10, 20]
    assert all(r.success and r.transfer_size == 2 * GPU_PAGE for r in results)
    assert handler.get_finished() == []


def test_wait_blocks_until_the_job_is_done_and_ignores_unknown_ids(
    handlers: WorkerHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    handler = handlers.store
    handler.transfer_async(1, one_block_spec(0, 0))
    threading.Timer(0.2, gate.opened.set).start()
    handler.wait([999, 1])
    assert gate.opened.is_set()
    assert [r.job_id for r in handler.get_finished()] == [1]
    handler.wait([1])  # finished and collected: nothing to wait for


def test_wait_retires_the_jobs_ahead_of_the_one_it_waits_for(
    handlers: WorkerHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    handler = handlers.store
    jobs = sample("kvshm_transfer_jobs_total", "gpu_to_cpu")
    for job_id in (1, 2, 3):
        handler.transfer_async(job_id, one_block_spec(job_id, job_id))
    threading.Timer(0.2, gate.opened.set).start()
    handler.wait({3})
    # job 1 ended while the wait blocked: it is counted already, and reported once
    assert sample("kvshm_transfer_jobs_total", "gpu_to_cpu") >= jobs + 1
    assert [r.job_id for r in handler.get_finished()] == [1, 2, 3]
    assert handler.get_finished() == []


def test_a_wait_lets_another_handler_retire_what_it_finished_meanwhile(
    handlers: WorkerHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in handlers.store.gpu_tensors]

    def is_store(batch: CopyBatch) -> bool:
        return not any(low <= batch.dst[0] < high for low, high in gpu)

    gate = Gate(monkeypatch, holds=is_store)
    store, load = handlers.store, handlers.load
    loads = sample("kvshm_transfer_jobs_total", "cpu_to_gpu")
    store.transfer_async(1, one_block_spec(1, 1))
    assert load.transfer_async(2, one_block_spec(2, 2)[::-1])
    load.wait({2})  # done, not yet retired
    threading.Timer(0.2, gate.opened.set).start()
    store.wait({1}, meanwhile=load.retire_finished)
    assert gate.opened.is_set()
    # the load was retired while the store's wait blocked: counted, and reported once
    assert sample("kvshm_transfer_jobs_total", "cpu_to_gpu") == loads + 1
    assert [r.job_id for r in load.get_finished()] == [2]
    assert [r.job_id for r in store.get_finished()] == [1]


def test_shutdown_waits_for_all_jobs_then_refuses_new_ones(
    handlers: WorkerHandlers, region: SharedOffloadRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    handler = handlers.store
    for job_id in range(3):
        handler.transfer_async(job_id, one_block_spec(job_id, job_id))
    threading.Timer(0.2, gate.opened.set).start()
    handler.shutdown()
    assert gate.started == [2, 2, 2]
    rows = region_bytes(region)
    for block in range(3):  # the last job's bytes are in the region
        at = 2 * CELL
        stored = rows[block, at : at + GPU_PAGE]
        np.testing.assert_array_equal(
            stored, handlers.store.gpu_tensors[0][block].numpy().view(np.uint8)
        )
    with pytest.raises(HandlerClosedError, match="shut down"):
        handler.transfer_async(5, one_block_spec(0, 0))
    handler.shutdown()  # idempotent


def sample(name: str, direction: str) -> float:
    labels = {"direction": direction}
    if name == "kvshm_transfer_jobs_total":
        labels["backend"] = "cpu"  # the backend that moves every job here
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_failed_job_is_reported_and_counted_and_the_next_one_runs(
    handlers: WorkerHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = CpuMemmoveBackend.copy

    def fail_job_two(
        backend: CpuMemmoveBackend, batch: CopyBatch, stream: object, after: object = None
    ) -> None:
        if batch.src[0] == handlers.store.gpu_tensors[0][2].data_ptr():
            raise OSError("simulated copy failure")
        original(backend, batch, stream)

    monkeypatch.setattr(CpuMemmoveBackend, "copy", fail_job_two)
    handler = handlers.store
    failures = sample("kvshm_transfer_failures_total", "gpu_to_cpu")
    jobs = sample("kvshm_transfer_jobs_total", "gpu_to_cpu")
    moved = sample("kvshm_transfer_bytes_total", "gpu_to_cpu")
    for job_id in (1, 2, 3):
        assert handler.transfer_async(job_id, one_block_spec(job_id, job_id))
    results = finish(handler, [3])

    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert sample("kvshm_transfer_failures_total", "gpu_to_cpu") == failures + 1
    assert sample("kvshm_transfer_jobs_total", "gpu_to_cpu") == jobs + 2
    assert sample("kvshm_transfer_bytes_total", "gpu_to_cpu") == moved + 2 * 2 * GPU_PAGE


def test_metrics_count_bytes_seconds_and_sizes_per_direction(
    handlers: WorkerHandlers,
) -> None:
    before = {
        name: sample(name, "cpu_to_gpu")
        for name in (
            "kvshm_transfer_bytes_total",
            "kvshm_transfer_jobs_total",
            "kvshm_transfer_size_bytes_count",
            "kvshm_transfer_size_bytes_sum",
        )
    }
    spec = (CPULoadStoreSpec([4]), GPULoadStoreSpec([9], [1, 0, 0], [0, 0, 0]))
    handlers.load.transfer_async(1, spec)
    finish(handlers.load, [1])
    assert (
        sample("kvshm_transfer_bytes_total", "cpu_to_gpu")
        == before["kvshm_transfer_bytes_total"] + 128
    )
    assert (
        sample("kvshm_transfer_jobs_total", "cpu_to_gpu") == before["kvshm_transfer_jobs_total"] + 1
    )
    assert (
        sample("kvshm_transfer_size_bytes_count", "cpu_to_gpu")
        == before["kvshm_transfer_size_bytes_count"] + 1
    )
    assert (
        sample("kvshm_transfer_size_bytes_sum", "cpu_to_gpu")
        == before["kvshm_transfer_size_bytes_sum"] + 128
    )
    assert sample("kvshm_transfer_seconds_total", "cpu_to_gpu") > 0


def test_an_empty_job_finishes_with_zero_bytes(handlers: WorkerHandlers) -> None:
    spec = (GPULoadStoreSpec([], [0, 0, 0], [0, 0, 0]), CPULoadStoreSpec([]))
    assert handlers.store.transfer_async(4, spec)
    [result] = finish(handlers.store, [4])
    assert (result.job_id, result.success, result.transfer_size) == (4, True, 0)


def test_the_handler_keeps_its_tensors_alive() -> None:
    """The planner works with addresses: tensors the caller drops must not be freed."""
    import gc

    def build() -> SingleDirectionOffloadingHandler:
        gpu = [torch.arange(64, dtype=torch.int8).reshape(4, 16)]
        cpu = [torch.zeros((4, 16), dtype=torch.int8)]
        return SingleDirectionOffloadingHandler(gpu, cpu, 1, [[CanonicalKVCacheRef(0, 16)]], True)

    handler = build()
    gc.collect()
    garbage = [torch.full((4, 16), 7, dtype=torch.int8) for _ in range(64)]  # reuse freed memory
    handler.transfer_async(1, (GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([3])))
    [result] = finish(handler, [1])
    assert result.success
    assert handler.cpu_tensors[0][3].tolist() == list(range(32, 48))
    assert all(bool((g == 7).all()) for g in garbage)
    handler.shutdown()
