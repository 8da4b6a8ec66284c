"""Sub-block pointer math: where GPU-sized pieces of (possibly larger) blocks live in memory.

A tensor's block b starts at base + b * row_stride. Its row stride is its stride along blocks,
which for a region view is the region's row stride (all workers' cells), not the row's width.
With block_size_factor f, a block holds f sub-blocks of row_width / f bytes each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvshm.transfer.errors import InvalidTransferSpecError

Pointers = npt.NDArray[np.int64]
PerTensor = int | npt.NDArray[np.int64]
"""One tensor's value, or a (1, refs) row of several tensors' values."""


@dataclass(frozen=True)
class RowGeometry:
    """Byte geometry of a tensor seen as rows of blocks."""

    base: int
    row_stride: int
    row_width: int
    num_rows: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> RowGeometry:
        if tensor.dim() < 1:
            raise InvalidTransferSpecError("a block tensor needs at least one dimension")
        element = tensor.element_size()
        inner = tuple(tensor.shape[1:])
        expected = 1
        for size, stride in reversed(list(zip(inner, tensor.stride()[1:], strict=True))):
            if size != 1 and stride != expected:
                raise InvalidTransferSpecError(
                    f"each block of a tensor must be contiguous, but a tensor of shape "
                    f"{tuple(tensor.shape)} has strides {tensor.stride()}: pass a view whose "
                    f"dimensions after the first are contiguous"
                )
            expected *= size
        return cls(
            base=tensor.data_ptr(),
            row_stride=tensor.stride(0) * element,
            row_width=math.prod(inner) * element,
            num_rows=tensor.shape[0],
        )


def check_factor_and_skip(block_size_factor: int, skip_count: int) -> None:
    if isinstance(block_size_factor, bool) or not isinstance(block_size_factor, int):
        raise InvalidTransferSpecError(
            f"block_size_factor must be an integer, got {block_size_factor!r}"
        )
    if block_size_factor < 1:
        raise InvalidTransferSpecError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if not 0 <= skip_count < block_size_factor:
        raise InvalidTransferSpecError(
            f"skip_count must be in [0, block_size_factor={block_size_factor}), got {skip_count}"
        )


def blocks_spanned(count: int, block_size_factor: int, skip_count: int) -> int:
    """How many blocks `count` sub-blocks occupy when the first `skip_count` are skipped."""
    if count == 0:
        return 0
    return -(-(count + skip_count) // block_size_factor)


def check_ids_in_range(block_ids: npt.NDArray[np.int64], num_rows: int, what: str) -> None:
    if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= num_rows):
        bad = block_ids[(block_ids < 0) | (block_ids >= num_rows)]
        raise InvalidTransferSpecError(
            f"{what} block ids must be in [0, {num_rows}); got {bad[:8].tolist()}"
            + (f" and {bad.size - 8} more" if bad.size > 8 else "")
        )


def fill_sub_block_ptrs(
    block_ids: npt.NDArray[np.int64],
    block_size_factor: int,
    output: npt.NDArray[np.int64],
    base: PerTensor,
    row_stride: PerTensor,
    sub_block_bytes: PerTensor,
    skip_count: int,
) -> None:
    """compute_sub_block_ptrs without checks: the caller has validated every argument.

    base, row_stride and sub_block_bytes are one tensor's (ints, output of shape (n,)) or
    several tensors' ((1, refs) arrays, output of shape (n, refs): row k holds sub-block k of
    every tensor)."""
    count = len(output)
    column = (slice(None), None) if output.ndim == 2 else (slice(None),)
    if block_size_factor == 1:
        np.multiply(block_ids[:count][column], row_stride, out=output)
    else:
        positions = np.arange(skip_count, skip_count + count, dtype=np.int64)
        blocks, slots = np.divmod(positions, block_size_factor)
        np.multiply(block_ids[blocks][column], row_stride, out=output)
        output += np.multiply(slots[column], sub_block_bytes, dtype=np.int64)
    output += base


def compute_sub_block_ptrs(
    block_ids: npt.NDArray[np.integer],
    block_size_factor: int,
    output: Pointers,
    tensor: torch.Tensor,
    skip_count: int = 0,
) -> None:
    """Write into `output` the addresses of len(output) consecutive sub-blocks of `block_ids`
    (ids at the tensor's own granularity), starting skip_count sub-blocks into the first block.

    Sub-block j of block b is at base + b * row_stride + j * (row_width / block_size_factor).
    """
    check_factor_and_skip(block_size_factor, skip_count)
    if not isinstance(output, np.ndarray) or output.dtype != np.int64 or output.ndim != 1:
        raise InvalidTransferSpecError("output must be a 1-D numpy array of dtype int64")
    geometry = RowGeometry.of(tensor)
    if geometry.row_width % block_size_factor:
        raise InvalidTransferSpecError(
            f"a row of {geometry.row_width} bytes does not split into {block_size_factor} "
            f"equal sub-blocks"
        )
    ids = np.asarray(block_ids)
    needed = blocks_spanned(len(output), block_size_factor, skip_count)
    if needed > len(ids):
        raise InvalidTransferSpecError(
            f"{len(output)} sub-blocks after skipping {skip_count} need {needed} blocks of "
            f"factor {block_size_factor}, but only {len(ids)} block ids were given"
        )
    used = ids[:needed].astype(np.int64, copy=False)
    check_ids_in_range(used, geometry.num_rows, "tensor")
    fill_sub_block_ptrs(
        used,
        block_size_factor,
        output,
        geometry.base,
        geometry.row_stride,
        geometry.row_width // block_size_factor,
        skip_count,
    )
