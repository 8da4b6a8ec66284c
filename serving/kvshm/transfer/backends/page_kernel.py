"""The staged backend's gather and scatter for uniform jobs, addressed from the block ids alone.

A uniform job's pages follow from its GPU block ids and the layout (kvshm.transfer.jobs.uniform):
page r of block k is at gpu_base[r] + id_k * gpu_stride[r] and at cell_offset[r] in the
block's cell in the staging buffer. So the kernel takes the ids as launch arguments and the
layout's per-ref table from device memory, uploaded once: no job writes a table, and the
kernel reads nothing from host memory. With a table in pinned host memory, its reads wait
behind the other direction's copies on the link, and the copies out waited for the gather,
which cost both ways several GB/s (docs/transfer.md).

Its programs have the copy kernel's shape (4 warps, 16 KiB a step). Programs of one warp and
32 registers, small enough to sit on an SM beside a matrix product's thread block, slowed the
products beside more, not less.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvshm.transfer.backends.kernel import (
    DEFAULT_NUM_WARPS,
    CompiledLaunch,
    checked_launch,
    launch_constants,
)
from kvshm.transfer.jobs.uniform import UniformLayout

I32_MAX = (1 << 31) - 1


class _Geometry(NamedTuple):
    """The kernel's arguments that a layout fixes."""

    table: int  # the per-ref (4, refs) table's device address
    refs: int
    block_bytes: int
    chunks_per_page: int


def page_kernel_refusal(layout: UniformLayout) -> str | None:
    """Why the page kernel cannot take this layout (its block ids and cell sizes are 32-bit
    launch arguments), or None."""
    if layout.gpu_rows - 1 > I32_MAX or layout.block_bytes > I32_MAX:
        return f"{layout.gpu_rows} GPU rows of {layout.block_bytes}-byte blocks: over 32 bits"
    return None


class PageKernel:
    """Gathers (GPU->CPU) or scatters (CPU->GPU) whole blocks of one uniform layout between
    the GPU tensors and a staging buffer, PAGE_KERNEL_BLOCKS blocks a launch."""

    def __init__(
        self,
        device: torch.device,
        layout: UniformLayout,
        gather: bool,
        chunk_bytes: int,
        programs: int,
    ) -> None:
        from kvshm.transfer.backends.triton_copy import PAGE_KERNEL_BLOCKS, copy_pages_kernel

        self._kernel: Any = copy_pages_kernel
        self.blocks_per_launch = PAGE_KERNEL_BLOCKS
        self._gather = gather
        self._chunk = chunk_bytes
        self._programs = programs
        columns = [layout.gpu_base, layout.gpu_stride, layout.cell_offset, layout.page]
        with torch.cuda.device(device):
            # uploaded once, while the handler is built
            self._table = torch.from_numpy(np.stack(columns)).to(device)
            chunks = -(-layout.largest_page // chunk_bytes)
            self._geometry = _Geometry(
                self._table.data_ptr(), layout.refs, layout.block_bytes, chunks
            )
            self._direct = self._direct_launcher(device)

    def launch(self, gpu_ids: npt.NDArray[np.int64], staged: int, stream: int) -> None:
        """Move blocks gpu_ids (in order) to or from the cells at staged, staged +
        block_bytes, ... on a stream (a raw handle)."""
        per_launch, geometry = self.blocks_per_launch, self._geometry
        for first in range(0, len(gpu_ids), per_launch):
            ids = gpu_ids[first : first + per_launch].tolist()
            args = self._arguments(geometry, ids, staged + first * geometry.block_bytes)
            grid = min(len(ids) * geometry.refs * geometry.chunks_per_page, self._programs)
            if self._direct is not None:
                self._direct(args, grid, stream)
            else:
                self._jit_launch(args, grid, stream)

    def _arguments(self, geometry: _Geometry, ids: list[int], staged: int) -> tuple[int, ...]:
        """The kernel's arguments: the geometry's and the blocks' ids, padded to
        PAGE_KERNEL_BLOCKS."""
        pad = [0] * (self.blocks_per_launch - len(ids))
        table, refs, block_bytes, chunks = geometry
        return (table, refs, staged, block_bytes, len(ids), chunks, *ids, *pad)

    def _jit_launch(self, args: tuple[int, ...], grid: int, stream: int) -> Any:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            return self._kernel[(grid,)](
                *args, CHUNK_BYTES=self._chunk, GATHER=self._gather, num_warps=DEFAULT_NUM_WARPS
            )

    def _direct_launcher(self, device: torch.device) -> CompiledLaunch | None:
        """Compile, then check a direct launch on a probe (as KernelBackend does): rows of
        16 bytes in one tensor, one ref, the 'buffer' in the same tensor."""
        probe = torch.arange(64, dtype=torch.uint8, device=device)
        at = probe.data_ptr()
        table = torch.tensor([[at], [16], [0], [16]], dtype=torch.int64, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        expected = probe.clone()
        # gather: GPU row 1 to the cell at 32, then (directly) row 2 to the cell at 48;
        # scatter: the cell at 0 to GPU row 2, then (directly) the cell at 16 to row 3
        moves = ((1, 32), (2, 48)) if self._gather else ((2, 0), (3, 16))
        (first, cell), (second, second_cell) = moves
        for row, at_cell in ((first, cell), (second, second_cell)):
            src, dst = (16 * row, at_cell) if self._gather else (at_cell, 16 * row)
            expected[dst : dst + 16] = expected[src : src + 16].clone()
        geometry = _Geometry(table.data_ptr(), refs=1, block_bytes=16, chunks_per_page=1)
        compiled = self._jit_launch(self._arguments(geometry, [first], at + cell), 1, stream)

        def moves_the_second(launch: CompiledLaunch) -> bool:
            launch(self._arguments(geometry, [second], at + second_cell), 1, stream)
            torch.cuda.synchronize(device)
            return bool(torch.equal(probe, expected))

        constants = launch_constants(self._chunk, self._gather)
        direct = checked_launch(compiled, constants, moves_the_second, "page kernel")
        torch.cuda.synchronize(device)
        return direct
