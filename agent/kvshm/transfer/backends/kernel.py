"""The kernel backend: GPU threads read and write registered host memory directly.

For small blocks this beats the copy engines, whose cost per descriptor dominates there. It
needs Triton (shipped with torch's CUDA builds), every address and size a multiple of 16
bytes, and every CPU tensor registered with CUDA at the same address (else a thread would
fault and take the CUDA context down), so it is offered only after checking all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvshm.transfer.backends.base import CopyBackend, Stream
from kvshm.transfer.backends.cuda_driver import CudaDriver
from kvshm.transfer.batch import CopyBatch
from kvshm.transfer.options import DEFAULT_KERNEL_CHUNK_BYTES, DEFAULT_KERNEL_PROGRAMS
from kvshm.transfer.pointers import RowGeometry

DEFAULT_NUM_WARPS = 4


def unmapped_reason(driver: CudaDriver, cpu_geometries: Sequence[RowGeometry]) -> str | None:
    """Why the GPU cannot address some CPU tensor directly, or None if it can."""
    for i, geometry in enumerate(cpu_geometries):
        last = (geometry.num_rows - 1) * geometry.row_stride + geometry.row_width - 1
        for address in (geometry.base, geometry.base + max(last, 0)):
            mapped = driver.device_pointer(address)
            if mapped is None:
                return f"CPU tensor {i} is not registered with CUDA (pin the region first)"
            if mapped != address:
                return f"CPU tensor {i} is mapped at another device address ({mapped:#x})"
    return None


def triton_missing_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    return None


class KernelBackend(CopyBackend):
    name = "kernel"

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int = DEFAULT_KERNEL_CHUNK_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
        programs: int = DEFAULT_KERNEL_PROGRAMS,
    ) -> None:
        if chunk_bytes < 16 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes must be a power of two >= 16, got {chunk_bytes}")
        if programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
        from kvshm.transfer.backends.triton_copy import copy_blocks_kernel

        self._kernel: Any = copy_blocks_kernel
        self._chunk = chunk_bytes
        self._num_warps = num_warps
        self._max_programs = programs
        # compile now, while the handler is built, not in the first job (~0.5 s): one copy
        # of 0 bytes touches no memory but the table
        warmup = torch.zeros((3, 1), dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(device):
            self.launch(warmup, 0, 1, 1)
            torch.cuda.synchronize(device)

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> object:
        if batch.count == 0:
            return None
        # the kernel reads the table from pinned memory, so no copy engine uploads it (an
        # upload would queue behind the other direction's DMA); the caller keeps the table
        # alive until the kernel is done, and only then may torch's host allocator reuse it
        table = torch.empty((3, batch.count), dtype=torch.int64, pin_memory=True)
        table.copy_(batch.table)
        self.launch(table, 0, batch.count, int(batch.sizes.max()))
        return table

    def launch(self, table: torch.Tensor, start: int, count: int, max_size: int) -> None:
        """Copy columns start .. start+count of a pinned (3, n) table on the current stream."""
        chunks = -(-max_size // self._chunk)
        base, row = table.data_ptr() + 8 * start, 8 * table.shape[1]
        self._kernel[(min(count * chunks, self._max_programs),)](
            base,
            base + row,
            base + 2 * row,
            count,
            chunks,
            CHUNK_BYTES=self._chunk,
            num_warps=self._num_warps,
        )
