"""compute_sub_block_ptrs against a scalar reference and against the bytes it points at."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from kvshm.transfer import InvalidTransferSpecError, compute_sub_block_ptrs


def reference_ptrs(
    ids: list[int], factor: int, count: int, base: int, stride: int, width: int, skip: int
) -> list[int]:
    """One sub-block at a time, the way the layout is described in words."""
    sub_block = width // factor
    pointers = []
    for position in range(skip, skip + count):
        block, part = position // factor, position % factor
        pointers.append(base + ids[block] * stride + part * sub_block)
    return pointers


def strided_view(rows: int, width: int, stride: int, offset: int) -> torch.Tensor:
    """A region-like view: rows of `width` bytes, `stride` bytes apart, `offset` into a buffer."""
    backing = torch.randint(-128, 128, (rows * stride + offset,), dtype=torch.int8)
    return backing.as_strided((rows, width), (stride, 1), offset)


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize(("width", "stride", "offset"), [(64, 64, 0), (64, 256, 128)])
def test_matches_reference_for_random_ids_and_skips(
    factor: int, width: int, stride: int, offset: int
) -> None:
    rng = np.random.default_rng(factor * 1000 + stride)
    view = strided_view(40, width, stride, offset)
    for skip in range(factor):
        for _ in range(20):
            ids = rng.choice(40, size=int(rng.integers(1, 12)), replace=False)
            count = int(rng.integers(1, len(ids) * factor - skip + 1))
            output = np.full(count, -1, dtype=np.int64)
            compute_sub_block_ptrs(ids, factor, output, view, skip_count=skip)
            expected = reference_ptrs(
                ids.tolist(), factor, count, view.data_ptr(), stride, width, skip
            )
            assert output.tolist() == expected


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_pointers_address_the_right_bytes_of_a_strided_view(factor: int) -> None:
    width, stride = 96, 384  # row stride != row width, as in a 4-worker region
    view = strided_view(16, width, stride, offset=96)
    sub_block = width // factor
    ids = np.array([9, 2, 15, 0], dtype=np.int64)
    skip = factor - 1
    count = len(ids) * factor - skip
    output = np.empty(count, dtype=np.int64)
    compute_sub_block_ptrs(ids, factor, output, view, skip_count=skip)
    rows = view.numpy()
    for k, pointer in enumerate(output.tolist()):
        block, part = divmod(skip + k, factor)
        expected = rows[ids[block], part * sub_block : (part + 1) * sub_block].tobytes()
        assert ctypes.string_at(pointer, sub_block) == expected


def test_uses_only_the_blocks_it_needs() -> None:
    view = strided_view(8, 32, 32, 0)
    output = np.empty(3, dtype=np.int64)
    compute_sub_block_ptrs(np.array([1, 2, 7]), 1, output, view)
    assert output.tolist() == [view.data_ptr() + 32 * i for i in (1, 2, 7)]
    compute_sub_block_ptrs(np.array([5, 6, 7]), 4, output, view, skip_count=1)
    assert output.tolist() == [view.data_ptr() + 5 * 32 + 8 * j for j in (1, 2, 3)]


@pytest.mark.parametrize(
    ("ids", "factor", "count", "skip", "message"),
    [
        ([0, 1], 2, 2, 2, "skip_count must be in [0, block_size_factor=2)"),
        ([0, 1], 0, 2, 0, "block_size_factor must be >= 1"),
        ([0, 1], 3, 2, 0, "does not split into 3 equal sub-blocks"),
        ([0, 1], 2, 4, 1, "need 3 blocks of factor 2, but only 2 block ids were given"),
        ([0, 8], 1, 2, 0, "block ids must be in [0, 8); got [8]"),
        ([-1, 0], 1, 2, 0, "got [-1]"),
    ],
)
def test_bad_arguments_say_what_is_wrong(
    ids: list[int], factor: int, count: int, skip: int, message: str
) -> None:
    view = strided_view(8, 32, 64, 0)
    with pytest.raises(InvalidTransferSpecError, match=re.escape(message)):
        compute_sub_block_ptrs(np.array(ids), factor, np.empty(count, np.int64), view, skip)


def test_output_and_tensor_are_checked() -> None:
    view = strided_view(8, 32, 64, 0)
    with pytest.raises(InvalidTransferSpecError, match="int64"):
        compute_sub_block_ptrs(np.array([0]), 1, np.empty(1, np.int32), view)  # type: ignore[arg-type]
    columns = torch.zeros((8, 32), dtype=torch.int8).t()  # blocks not contiguous
    with pytest.raises(InvalidTransferSpecError, match="must be contiguous"):
        compute_sub_block_ptrs(np.array([0]), 1, np.empty(1, np.int64), columns)
