"""The strided backend (one 2-D copy per block) against the general planner's copies, on real
memory through a driver stand-in that performs each 2-D copy row by row; and which layouts
it takes (vLLM 0.33's layer-outer cache: one allocation, a layer's pages at one stride)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvshm.transfer import CanonicalKVCacheRef, CPULoadStoreSpec, GPULoadStoreSpec
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.strided import StridedBackend, strided_refusal
from kvshm.transfer.cuda.driver import CUDA_MEMCPY2D, CopyDirection, CudaDriver
from kvshm.transfer.jobs.plan import JobPlanner
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.uniform import MAX_PITCH, UniformLayout

from .test_staging import apply

PAGE = 512
LAYERS = 6
BLOCKS = 40  # GPU blocks per layer
CHUNKS = 24  # region rows (one worker, one block a row)
STREAM: Any = SimpleNamespace(cuda_stream=5)


class TwoDimensionalDriver:
    """cuMemcpy2DAsync's stand-in: records each call and copies its rows with memmove."""

    has_batch = False

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int, int]] = []

    def memcpy_2d(self, params: CUDA_MEMCPY2D, stream: int) -> int:
        src, dst = params.srcDevice, params.dstDevice
        self.calls.append(
            (src, params.srcPitch, dst, params.dstPitch, params.WidthInBytes, params.Height)
        )
        for row in range(params.Height):
            ctypes.memmove(
                dst + row * params.dstPitch, src + row * params.srcPitch, params.WidthInBytes
            )
        return 0


class Memory:
    """A layer-outer GPU cache in one allocation and a region of one worker's cells."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.gpu = rng.integers(0, 256, LAYERS * BLOCKS * PAGE, dtype=np.uint8)
        self.host = rng.integers(0, 256, CHUNKS * LAYERS * PAGE, dtype=np.uint8)

    def views(self, order: list[int] | None = None) -> tuple[list[RowGeometry], list[RowGeometry]]:
        """GPU tensor l: layer l's pages; CPU view l: page l of each cell."""
        gpu_at, host_at = self.gpu.ctypes.data, self.host.ctypes.data
        gpu = [
            RowGeometry(gpu_at + layer * BLOCKS * PAGE, PAGE, PAGE, BLOCKS)
            for layer in (order or range(LAYERS))
        ]
        cpu = [
            RowGeometry(host_at + layer * PAGE, LAYERS * PAGE, PAGE, CHUNKS)
            for layer in range(LAYERS)
        ]
        return gpu, cpu


REFS = [[CanonicalKVCacheRef(layer, PAGE) for layer in range(LAYERS)]]


def job(seed: int, gpu_to_cpu: bool) -> tuple[object, object]:
    rng = np.random.default_rng(seed)
    gpu = GPULoadStoreSpec(rng.choice(BLOCKS, 16, replace=False), [16], [0])
    cpu = CPULoadStoreSpec(rng.choice(CHUNKS, 16, replace=False))
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_one_2d_copy_a_block_moves_what_the_planners_copies_move(gpu_to_cpu: bool) -> None:
    spec = job(3, gpu_to_cpu)
    expected, strided = Memory(1), Memory(1)
    gpu, cpu = expected.views()
    apply(JobPlanner(gpu, cpu, 1, REFS, gpu_to_cpu).plan(spec).rows)
    gpu, cpu = strided.views()
    layout = UniformLayout.of(gpu, cpu, 1, REFS)
    assert layout is not None and layout.layer_pitch() == BLOCKS * PAGE
    driver = TwoDimensionalDriver()
    dma = DmaBackend(cast(CudaDriver, driver), CopyDirection(gpu_to_cpu, 0))
    backend = StridedBackend(cast(CudaDriver, driver), dma, gpu_to_cpu)
    assert backend.prepare_uniform(layout) is None
    uniform = layout.job(spec, gpu_to_cpu)
    assert uniform is not None
    backend.copy_uniform(uniform, STREAM)
    assert np.array_equal(strided.host, expected.host)
    assert np.array_equal(strided.gpu, expected.gpu)
    assert len(driver.calls) == 16  # a block a call, every layer's page in it
    assert {(width, height) for *_, width, height in driver.calls} == {(PAGE, LAYERS)}
    if gpu_to_cpu:  # into host memory in address order
        destinations = [call[2] for call in driver.calls]
        assert destinations == sorted(destinations)


def test_layouts_whose_pages_lie_at_one_stride_take_it() -> None:
    gpu, cpu = Memory(0).views()
    assert strided_refusal(UniformLayout.of(gpu, cpu, 1, REFS)) is None
    # layers given to vLLM in another order than the cell's: not one stride
    shuffled, _ = Memory(0).views([1, 0, 2, 3, 4, 5])
    assert strided_refusal(UniformLayout.of(shuffled, cpu, 1, REFS)) is not None
    # a tensor per layer, allocated apart (2**32 apart: beyond a 2-D copy's pitch)
    apart = [RowGeometry((1 << 40) + (t << 32), PAGE, PAGE, BLOCKS) for t in range(LAYERS)]
    assert MAX_PITCH < (1 << 32)
    assert "one stride" in str(strided_refusal(UniformLayout.of(apart, cpu, 1, REFS)))
    # a block-outer cache is one page a block: a 2-D copy adds nothing to DMA's one descriptor
    one = [RowGeometry(gpu[0].base, LAYERS * PAGE, LAYERS * PAGE, BLOCKS)]
    whole = [RowGeometry(cpu[0].base, LAYERS * PAGE, LAYERS * PAGE, CHUNKS)]
    packed = UniformLayout.of(one, whole, 1, [[CanonicalKVCacheRef(0, LAYERS * PAGE)]])
    assert packed is not None and packed.layer_pitch() is None
    # two blocks a chunk: not uniform
    assert "blocks_per_chunk" in str(strided_refusal(UniformLayout.of(gpu, cpu, 2, REFS)))
