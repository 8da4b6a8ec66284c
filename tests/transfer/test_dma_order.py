"""The order the DMA backend hands a job's copies to the driver (a driver that records them)."""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvshm.transfer import CPULoadStoreSpec, GPULoadStoreSpec
from kvshm.transfer.backends.dma import SORT_BELOW_BYTES, DmaBackend
from kvshm.transfer.cuda.driver import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_SUCCESS,
    CopyDirection,
    CudaDriver,
)
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.plan import JobPlanner
from kvshm.transfer.jobs.uniform import UniformLayout

from .helpers import CPU_ROWS, GPU_ROWS, cpu_views, gpu_views, one_group

KIB = 1024
MIB = 1024 * KIB
GPU = 1 << 40  # tensor t at GPU + t * 2**32, block b at + b * page
HOST = 1 << 30  # cell c at HOST + c * refs * page, page r of it at + r * page


class RecordingDriver:
    """cuMemcpyBatchAsync's stand-in: keeps each call's (sources, destinations, sizes)."""

    has_batch = True

    def __init__(self) -> None:
        self.calls: list[np.ndarray] = []

    def memcpy_batch(
        self, dst: int, src: int, sizes: int, count: int, attributes: object, stream: int
    ) -> int:
        def read(at: int) -> list[int]:
            return list((ctypes.c_int64 * count).from_address(at))

        self.calls.append(np.array([read(src), read(dst), read(sizes)]))
        return CUDA_SUCCESS

    def issued(self) -> np.ndarray:
        return np.concatenate(self.calls, axis=1)


def planned_job(
    blocks: list[int], cells: list[int], refs: int, page: int, gpu_to_cpu: bool
) -> CopyBatch:
    """A job as the planner emits it: block by block, each block's pages in cell order."""
    gpu = [GPU + (t << 32) + b * page for b in blocks for t in range(refs)]
    host = [HOST + (c * refs + t) * page for c in cells for t in range(refs)]
    batch = CopyBatch.allocate(len(gpu))
    batch.rows[:] = [gpu, host, [page] * len(gpu)] if gpu_to_cpu else [host, gpu, [page] * len(gpu)]
    return batch.with_total(len(gpu) * page)


def backend(gpu_to_cpu: bool) -> tuple[DmaBackend, RecordingDriver]:
    driver = RecordingDriver()
    dma = DmaBackend(cast(CudaDriver, driver), CopyDirection(gpu_to_cpu, 0), 128)
    return dma, driver


STREAM: Any = SimpleNamespace(cuda_stream=7)


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_large_pages_go_tensor_by_tensor_so_consecutive_copies_change_cells(
    gpu_to_cpu: bool,
) -> None:
    """From SORT_BELOW_BYTES a copy, a job goes in ascending GPU address: tensor by tensor,
    so consecutive copies land in different cells (F38); every copy whole, none lost."""
    dma, driver = backend(gpu_to_cpu)
    job = planned_job([5, 2, 9], [0, 7, 3], 4, 2 * MIB, gpu_to_cpu)
    dma.copy(job, STREAM)
    issued = driver.issued()
    gpu_row = 0 if gpu_to_cpu else 1
    assert issued[gpu_row].tolist() == sorted(job.rows[gpu_row].tolist())
    assert sorted(map(tuple, issued.T.tolist())) == sorted(map(tuple, job.rows.T.tolist()))
    tensors = (issued[gpu_row] - GPU) >> 32
    assert tensors.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    host = issued[1 - gpu_row]
    assert all(abs(b - a) != 2 * MIB for a, b in itertools.pairwise(host))


def test_small_stores_go_in_host_address_order_and_small_loads_as_planned() -> None:
    page = 64 * KIB
    assert page < SORT_BELOW_BYTES
    store, recorded = backend(True)
    job = planned_job([5, 2, 9], [4, 1, 3], 2, page, True)
    store.copy(job, STREAM)
    assert recorded.issued()[1].tolist() == sorted(job.rows[1].tolist())
    load, recorded = backend(False)
    job = planned_job([5, 2, 9], [4, 1, 3], 2, page, False)
    load.copy(job, STREAM)
    assert np.array_equal(recorded.issued(), job.rows)


def test_issue_keeps_the_batch_order() -> None:
    """The staged backend's runs (whole cells, already in buffer order) are issued as given."""
    dma, driver = backend(True)
    job = planned_job([5, 2, 9], [4, 1, 3], 1, 2 * MIB, True)
    dma.issue(job, STREAM)
    assert np.array_equal(driver.issued(), job.rows)


class ContextlessDriver(RecordingDriver):
    """Refuses batch calls (as the driver does) until a context is made current."""

    def __init__(self) -> None:
        super().__init__()
        self.context = False

    def has_current_context(self) -> bool:
        return self.context

    def memcpy_batch(
        self, dst: int, src: int, sizes: int, count: int, attributes: object, stream: int
    ) -> int:
        if not self.context:
            return CUDA_ERROR_INVALID_VALUE
        return super().memcpy_batch(dst, src, sizes, count, attributes, stream)


def test_a_thread_without_a_context_gets_the_devices_and_keeps_batching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Falling back to a call per copy there moved 3-10 GB/s where the batch call moves 51."""
    driver = ContextlessDriver()
    made_current: list[int] = []

    def set_device(index: int) -> None:
        made_current.append(index)
        driver.context = True

    monkeypatch.setattr("torch.cuda.set_device", set_device)
    dma = DmaBackend(cast(CudaDriver, driver), CopyDirection(True, 3), 128)
    job = planned_job([5, 1, 4], [0, 2, 1], 2, 32 * KIB, True)
    dma.issue(job, STREAM)
    assert made_current == [3]
    assert dma.uses_batch
    assert driver.issued().tolist() == job.rows.tolist()


def test_a_stream_the_driver_refuses_with_a_context_current_falls_back_to_single_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = ContextlessDriver()
    driver.context = True
    monkeypatch.setattr(driver, "memcpy_batch", lambda *args: CUDA_ERROR_INVALID_VALUE)
    single: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        driver,
        "memcpy",
        lambda dst, src, size, stream: single.append((src, dst, size)) or 0,
        raising=False,
    )
    dma = DmaBackend(cast(CudaDriver, driver), CopyDirection(False, 0), 128)
    job = planned_job([2, 7], [3, 0], 2, 16 * KIB, False)
    dma.issue(job, STREAM)
    assert not dma.uses_batch
    assert single == [tuple(column) for column in job.rows.T.tolist()]


def uniform(refs: int, page: int, gpu_to_cpu: bool, gpu_descending: bool) -> tuple[Any, Any]:
    """A uniform layout (kvshm.transfer.jobs.uniform) over `refs` tensors of one page a block, and
    the general planner of the same tensors. gpu_descending: the tensors' GPU bases run
    against their cells' order."""
    pages = [page] * refs
    gpu = gpu_views(pages)[:: -1 if gpu_descending else 1]
    cpu, group = cpu_views(pages, refs * page, HOST), one_group(pages)
    layout = UniformLayout.of(gpu, cpu, 1, group)
    assert layout is not None
    return layout, JobPlanner(gpu, cpu, 1, group, gpu_to_cpu)


@pytest.mark.parametrize("gpu_descending", [False, True], ids=["gpu-ascending", "gpu-descending"])
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
@pytest.mark.parametrize(
    ("refs", "page"),
    [(1, 896 * KIB), (4, 2 * MIB), (28, 32 * KIB), (3, 64 * KIB), (1, 16 * KIB)],
    ids=["block-outer", "2mib-blocks", "layer-outer", "three-tensors", "one-small-page"],
)
def test_a_uniform_job_issues_what_the_planners_copies_issue(
    refs: int, page: int, gpu_to_cpu: bool, gpu_descending: bool
) -> None:
    """copy_uniform builds its table from the ids: the same copies, in the same order, as
    copy() issues for the general planner's table of the job."""
    layout, planner = uniform(refs, page, gpu_to_cpu, gpu_descending)
    rng = np.random.default_rng(refs * page)
    for count in (1, 16, 5):
        gpu_ids, cpu_ids = rng.permutation(GPU_ROWS)[:count], rng.permutation(CPU_ROWS)[:count]
        pair = (GPULoadStoreSpec(gpu_ids.tolist(), [count], [0]), CPULoadStoreSpec(cpu_ids))
        spec: tuple[Any, Any] = pair if gpu_to_cpu else pair[::-1]
        planned, expected = backend(gpu_to_cpu)
        planned.copy(planner.plan(spec), STREAM)
        dma, issued = backend(gpu_to_cpu)
        dma.prepare_uniform(layout)
        job = layout.job(spec, gpu_to_cpu)
        assert job is not None
        dma.copy_uniform(job, STREAM)
        assert np.array_equal(issued.issued(), expected.issued())
        assert issued.issued()[2].sum() == job.total_bytes == count * refs * page


def test_copy_uniform_needs_the_layout_first() -> None:
    layout, _ = uniform(1, 2 * MIB, True, False)
    job = layout.job((GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([2])), True)
    assert job is not None
    with pytest.raises(ValueError, match="prepare_uniform"):
        backend(True)[0].copy_uniform(job, STREAM)
