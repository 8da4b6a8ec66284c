"""The descriptor table: column slices and the destination order DMA stores are issued in."""

from __future__ import annotations

import numpy as np

from kvshm.transfer.batch import CopyBatch


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
