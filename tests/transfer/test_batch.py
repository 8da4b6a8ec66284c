"""The descriptor table: column slices and the destination order DMA stores are issued in."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvshm.transfer.jobs.batch import CopyBatch


def batch_of(src: list[int], dst: list[int], sizes: list[int]) -> CopyBatch:
    batch = CopyBatch.allocate(len(src))
    batch.rows[:] = [src, dst, sizes]
    return batch.with_total(sum(sizes))


def test_sorted_by_destination_moves_whole_copies_and_keeps_ties_in_order() -> None:
    batch = batch_of([10, 20, 30, 40], [400, 100, 300, 100], [1, 2, 3, 4])
    ordered = batch.sorted_by_destination()
    assert ordered.rows.tolist() == [[20, 40, 30, 10], [100, 100, 300, 400], [2, 4, 3, 1]]
    assert ordered.total_bytes == batch.total_bytes == 10
    assert batch.rows[1].tolist() == [400, 100, 300, 100]  # the original is left alone
    assert ordered.table.numpy().tolist() == ordered.rows.tolist()


def test_a_sorted_batch_is_returned_as_it_is() -> None:
    batch = batch_of([1, 2, 3], [10, 20, 30], [4, 4, 4])
    assert batch.sorted_by_destination() is batch


def test_columns_share_memory_and_count_their_bytes() -> None:
    batch = batch_of([1, 2, 3, 4], [5, 6, 7, 8], [16, 32, 48, 64])
    middle = batch.columns(1, 3)
    assert middle.rows.tolist() == [[2, 3], [6, 7], [32, 48]]
    assert middle.total_bytes == 80 and middle.count == 2
    middle.rows[0, 0] = 99
    assert batch.rows[0, 1] == 99
    assert middle.rows[1].ctypes.data == batch.rows[1].ctypes.data + 8  # rows stay contiguous
    assert np.shares_memory(middle.table.numpy(), batch.table.numpy())


def test_a_batch_tells_where_its_rows_start_for_the_driver() -> None:
    batch = CopyBatch.allocate(6)
    batch.rows[:] = np.arange(18, dtype=np.int64).reshape(3, 6)
    for part in (batch, batch.columns(2, 5)):
        for row, address in enumerate(part.addresses):
            read = (ctypes.c_int64 * part.count).from_address(address)
            assert list(read) == part.rows[row].tolist()
    transposed = CopyBatch(batch.table, np.asfortranarray(batch.rows), 0)
    with pytest.raises(ValueError, match="rows must each be contiguous"):
        _ = transposed.addresses
