"""One worker of the two-GPU test: attach the region as `rank` on GPU `rank`, store its cells.

Run as a script: python two_gpu_worker.py DIRECTORY INSTANCE RANK NUM_BLOCKS BLOCK_BYTES
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvshm.region import OpenMode, RegionFormat, RegionLayout, SharedOffloadRegion
from kvshm.transfer import (
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    HandlerLayout,
)


def worker_data(rank: int, num_blocks: int, block: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-128, 128, (num_blocks, block), dtype=torch.int8, generator=generator)


def main(directory: str, instance: str, rank: int, num_blocks: int, block: int) -> None:
    torch.cuda.set_device(rank)
    region = SharedOffloadRegion(
        instance,
        RegionLayout(num_blocks, block, 2, RegionFormat.UNPADDED),  # as helpers.open_region
        rank,
        directory=directory,
        mode=OpenMode.ATTACH,
    )
    with region:
        gpu = [worker_data(rank, num_blocks, block).cuda()]
        region.pin()
        layout = HandlerLayout.over_region(gpu, region, 1, [[CanonicalKVCacheRef(0, block)]])
        store = layout.handler(True)
        ids = np.arange(num_blocks)
        spec = (GPULoadStoreSpec(ids[::-1].copy(), [num_blocks], [0]), CPULoadStoreSpec(ids))
        assert store.transfer_async(1, spec)
        store.wait([1])
        [result] = store.get_finished()
        assert result.success
        store.shutdown()
    print(f"rank {rank} stored {result.transfer_size} bytes on {torch.cuda.get_device_name(rank)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
