"""The pair of handlers over a region: views in order, both directions, view overflow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshm.region import InvalidLayoutError
from kvshm.transfer import (
    CanonicalKVCacheRef,
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
)

from .helpers import open_region, region_bytes, unpadded


def test_views_are_this_workers_consecutive_slices_of_its_cell(tmp_path: object) -> None:
    with open_region(str(tmp_path), unpadded(6, 3 * 64, 2), 1) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8), torch.zeros((4, 16), dtype=torch.int8)]
        refs = [[CanonicalKVCacheRef(0, 32), CanonicalKVCacheRef(1, 16)]]
        pair = CpuGpuOffloadingHandlers(gpu, region, 2, refs)
        first, second = pair.cpu_tensors
        assert first.shape == (6, 64) and second.shape == (6, 32)
        assert first.stride() == second.stride() == (2 * 3 * 64, 1)
        base = region.address
        assert first.data_ptr() == base + 3 * 64  # rank 1's cell
        assert second.data_ptr() == base + 3 * 64 + 64
        assert pair.gpu_to_cpu_handler.backends == pair.cpu_to_gpu_handler.backends == ["cpu"]
        pair.shutdown()


def test_round_trip_through_both_handlers(tmp_path: object) -> None:
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.randint(-128, 128, (4, 32), dtype=torch.int8)]
        pair = CpuGpuOffloadingHandlers(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        store = (GPULoadStoreSpec([3, 1, 2], [3], [1]), CPULoadStoreSpec([5, 0]))
        assert pair.gpu_to_cpu_handler.transfer_async(1, store)
        pair.gpu_to_cpu_handler.wait([1])
        rows = region_bytes(region)
        np.testing.assert_array_equal(rows[5, 32:64], gpu[0][3].numpy().view(np.uint8))
        np.testing.assert_array_equal(rows[0, :32], gpu[0][1].numpy().view(np.uint8))
        np.testing.assert_array_equal(rows[0, 32:], gpu[0][2].numpy().view(np.uint8))
        expected = gpu[0][[3, 1, 2]].clone()
        gpu[0].zero_()
        load = (CPULoadStoreSpec([5, 0]), GPULoadStoreSpec([0, 1, 2], [3], [1]))
        assert pair.cpu_to_gpu_handler.transfer_async(2, load)
        pair.cpu_to_gpu_handler.wait([2])
        assert torch.equal(gpu[0][:3], expected)
        assert [r.job_id for r in pair.gpu_to_cpu_handler.get_finished()] == [1]
        assert [r.job_id for r in pair.cpu_to_gpu_handler.get_finished()] == [2]
        pair.shutdown()


def test_tensors_that_do_not_fit_the_cell_are_refused(tmp_path: object) -> None:
    with open_region(str(tmp_path), unpadded(4, 64, 2), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8) for _ in range(3)]
        with pytest.raises(InvalidLayoutError, match="overflows worker 0's 64-byte cell by 32"):
            CpuGpuOffloadingHandlers(gpu, region, 1, [[CanonicalKVCacheRef(0, 32)]])
