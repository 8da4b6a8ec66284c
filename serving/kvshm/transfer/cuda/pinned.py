"""Pinned descriptor tables lent to jobs and taken back when the jobs are retired.

The copy kernel reads its table from pinned host memory while the job runs, so each job in
flight needs a table of its own. torch's pinned allocator costs a good part of a job's CPU
budget a call (docs/transfer.md); a table given back when its job is retired, and lent
again, costs a list pop. Tables come in power-of-two widths, so jobs of
any size share a few free lists; a kernel given a table reads its rows at the table's width.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvshm.transfer.jobs.work import Lease

MIN_COLUMNS = 64
BYTES_KEPT = 16 << 20
"""Free tables kept per pool, in bytes; beyond it a given-back table is left to torch."""


class PinnedTable(Lease):
    """A (3, width) int64 table, pinned, lent for one job: `rows` is the same memory."""

    __slots__ = ("_pool", "rows", "tensor")

    def __init__(self, pool: PinnedTables, tensor: torch.Tensor) -> None:
        self._pool = pool
        self.tensor = tensor
        self.rows: npt.NDArray[np.int64] = tensor.numpy()

    def release(self) -> None:
        self._pool.give_back(self)


class PinnedTables:
    """Lends (3, width) int64 tables of at least the asked width; pinned=False (no CUDA)
    lends ordinary memory, for tests."""

    def __init__(self, pinned: bool = True, bytes_kept: int = BYTES_KEPT) -> None:
        self._pinned = pinned
        self._bytes_kept = bytes_kept
        self._kept = 0
        self._free: dict[int, list[PinnedTable]] = {}

    def take(self, columns: int) -> PinnedTable:
        width = max(MIN_COLUMNS, 1 << max(columns - 1, 0).bit_length())
        free = self._free.get(width)
        if free:
            table = free.pop()
            self._kept -= table.rows.nbytes
            return table
        tensor = torch.empty((3, width), dtype=torch.int64, pin_memory=self._pinned)
        return PinnedTable(self, tensor)

    def give_back(self, table: PinnedTable) -> None:
        """Keep a table whose job is done (its kernel has read it) for the next job."""
        if self._kept + table.rows.nbytes > self._bytes_kept:
            return
        self._kept += table.rows.nbytes
        self._free.setdefault(table.rows.shape[1], []).append(table)

    @property
    def bytes_kept(self) -> int:
        return self._kept
