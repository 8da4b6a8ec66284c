"""Per-job backend choice by block size and direction, and the override."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch

from kvshm.transfer import BackendPolicy, BackendUnavailableError, Direction
from kvshm.transfer.backends.base import CopyBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.choice.chooser import BackendChooser
from kvshm.transfer.cuda.driver import CopyDirection, CudaDriver
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.uniform import UniformLayout
from kvshm.transfer.jobs.work import Stream

from .helpers import cpu_views, gpu_views, one_group


class Named(CopyBackend):
    def __init__(self, name: str) -> None:
        self.label = name

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> None:
        raise AssertionError("never called here")


def batch_of(count: int, each: int) -> CopyBatch:
    return CopyBatch.allocate(count).with_total(count * each)


POLICY = BackendPolicy({Direction.CPU_TO_GPU: 128 * 1024, Direction.GPU_TO_CPU: 0})


def chooser(direction: Direction, override: str | None = None) -> BackendChooser:
    backends = {"dma": Named("dma"), "kernel": Named("kernel")}
    return BackendChooser(backends, {"cpu": "no"}, direction, POLICY, override)


def label(backend: CopyBackend) -> str:
    assert isinstance(backend, Named)
    return backend.label


def test_small_blocks_go_to_the_kernel_large_ones_to_dma() -> None:
    load = chooser(Direction.CPU_TO_GPU)
    assert label(load.choose(batch_of(100, 16 * 1024))) == "kernel"
    assert label(load.choose(batch_of(100, 64 * 1024))) == "kernel"
    assert label(load.choose(batch_of(10, 128 * 1024))) == "dma"
    assert label(load.choose(batch_of(4, 2 * 1024 * 1024))) == "dma"


def test_thresholds_are_per_direction() -> None:
    store = chooser(Direction.GPU_TO_CPU)
    assert label(store.choose(batch_of(100, 16 * 1024))) == "dma"


def test_override_wins_and_must_exist() -> None:
    assert label(chooser(Direction.GPU_TO_CPU, "kernel").choose(batch_of(1, 2**21))) == "kernel"
    with pytest.raises(BackendUnavailableError, match="'cpu' cannot be used: no"):
        chooser(Direction.GPU_TO_CPU, "cpu")


def test_without_a_kernel_everything_goes_to_dma() -> None:
    only_dma = BackendChooser(
        {"dma": Named("dma")}, {"kernel": "x"}, Direction.CPU_TO_GPU, POLICY, None
    )
    assert label(only_dma.choose(batch_of(100, 16 * 1024))) == "dma"


def cells_batch(tensors: int, page: int, blocks: int, gpu_to_cpu: bool) -> CopyBatch:
    """A job moving `tensors` pages of `blocks` random region rows (4 workers), block by
    block as the planner orders it: each block's pages are one run of the region."""
    row = 4 * tensors * page
    rows = np.random.default_rng(0).permutation(10 * blocks)[:blocks]
    host = np.array([r * row + t * page for r in rows for t in range(tensors)], dtype=np.int64)
    batch = CopyBatch.allocate(len(host))
    batch.rows[1 if gpu_to_cpu else 0] = host + (1 << 30)
    batch.rows[0 if gpu_to_cpu else 1] = np.arange(len(host)) * 2 * page  # "GPU" side
    batch.rows[2] = page
    return batch.with_total(len(host) * page)


def staging_chooser(direction: Direction, policy: BackendPolicy | None = None) -> BackendChooser:
    gpu_to_cpu = direction == Direction.GPU_TO_CPU
    staged = StagedBackend(
        torch.device("cpu"), gpu_to_cpu, Named("dma"), Named("kernel"), 8 << 20, 2
    )  # type: ignore[arg-type]
    backends = {"dma": Named("dma"), "kernel": Named("kernel"), "staged": staged}
    return BackendChooser(backends, {}, direction, policy or BackendPolicy(), None)


@pytest.mark.parametrize("direction", list(Direction))
def test_jobs_whose_region_side_forms_long_runs_are_staged(direction: Direction) -> None:
    choose = staging_chooser(direction).choose
    gpu_to_cpu = direction == Direction.GPU_TO_CPU
    # 32 layers of 16 KiB pages: one 512 KiB run per block
    assert choose(cells_batch(32, 16 * 1024, 64, gpu_to_cpu)).name == "staged"
    # 2 tensors of 16 KiB pages: 32 KiB runs, too short to pay for staging
    assert label(choose(cells_batch(2, 16 * 1024, 64, gpu_to_cpu))) == "kernel"
    # 64 KiB pages in 2 MiB runs are staged too; 128 KiB and 2 MiB pages are large enough
    assert choose(cells_batch(32, 64 * 1024, 8, gpu_to_cpu)).name == "staged"
    assert label(choose(cells_batch(32, 128 * 1024, 8, gpu_to_cpu))) == "dma"
    assert label(choose(cells_batch(2, 2 << 20, 8, gpu_to_cpu))) == "dma"


def test_a_copy_larger_than_the_staging_buffer_is_not_staged() -> None:
    policy = BackendPolicy(staged_from_run_bytes=64 << 20, staged_below_copy_bytes=32 << 20)
    choose = staging_chooser(Direction.GPU_TO_CPU, policy).choose
    assert label(choose(cells_batch(4, 16 << 20, 2, True))) == "dma"  # 16 MiB > 8 MiB buffer


def uniform_layout(refs: int, page: int) -> UniformLayout:
    pages = [page] * refs
    layout = UniformLayout.of(gpu_views(pages), cpu_views(pages, refs * page), 1, one_group(pages))
    assert layout is not None
    return layout


def dma_chooser(override: str | None = None, staged: bool = False) -> BackendChooser:
    dma = DmaBackend(cast(CudaDriver, SimpleNamespace(has_batch=True)), CopyDirection(True, 0))
    backends: dict[str, CopyBackend] = {"dma": dma, "kernel": Named("kernel")}
    if staged:
        backends["staged"] = StagedBackend(
            torch.device("cpu"), True, dma, Named("kernel"), 8 << 20, 2
        )  # type: ignore[arg-type]
    return BackendChooser(backends, {}, Direction.GPU_TO_CPU, BackendPolicy(), override)


def test_uniform_jobs_skip_planning_for_dma_only_where_every_job_would_get_it() -> None:
    block_outer, small = uniform_layout(1, 896 * 1024), uniform_layout(2, 16 * 1024)
    layer_outer = uniform_layout(32, 64 * 1024)
    chooser = dma_chooser()
    assert chooser.dma_for_uniform(block_outer) is chooser.dma() is not None
    assert chooser.dma_for_uniform(small) is None  # the kernel's
    assert chooser.dma_for_uniform(layer_outer) is chooser.dma()  # no staged backend here
    staging = dma_chooser(staged=True)
    assert staging.dma_for_uniform(layer_outer) is None  # some jobs are staged
    assert staging.dma_for_uniform(block_outer) is staging.dma()
    assert dma_chooser("dma").dma_for_uniform(small) is not None
    assert dma_chooser("kernel").dma_for_uniform(block_outer) is None
    cpu = BackendChooser({"cpu": Named("cpu")}, {}, Direction.GPU_TO_CPU, BackendPolicy(), None)
    assert cpu.dma() is None and cpu.dma_for_uniform(block_outer) is None
