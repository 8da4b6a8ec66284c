"""A job's copies as one descriptor table: source addresses, destination addresses, sizes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class CopyBatch:
    """table is a (3, count) int64 CPU tensor: row 0 holds source addresses, row 1 destination
    addresses, row 2 sizes in bytes. `rows` is the same memory as a numpy array."""

    table: torch.Tensor
    rows: npt.NDArray[np.int64]
    total_bytes: int

    @classmethod
    def allocate(cls, count: int, pinned: bool = False) -> CopyBatch:
        if pinned:
            table = torch.empty((3, count), dtype=torch.int64, pin_memory=True)
            return cls(table, table.numpy(), 0)
        # numpy first: a job's planning allocates one, and torch.empty costs more per call
        rows = np.empty((3, count), dtype=np.int64)
        return cls(torch.from_numpy(rows), rows, 0)

    def with_total(self, total_bytes: int) -> CopyBatch:
        return CopyBatch(self.table, self.rows, total_bytes)

    def columns(self, start: int, stop: int) -> CopyBatch:
        """Copies start .. stop as a batch sharing this one's memory (each row contiguous)."""
        if start == 0 and stop >= self.count:
            return self  # a one-piece job: no slicing on the issuing thread
        rows = self.rows[:, start:stop]
        return CopyBatch(self.table[:, start:stop], rows, int(rows[2].sum()))

    def sorted_by_destination(self) -> CopyBatch:
        """The same copies, in ascending destination address (equal ones keep their order)."""
        return self.sorted_by(1)

    def sorted_by(self, row: int) -> CopyBatch:
        """The same copies, in ascending order of row 0 (sources) or 1 (destinations); equal
        ones keep their order, and a batch already in order is returned as it is."""
        order = np.argsort(self.rows[row], kind="stable")
        if np.all(order[1:] > order[:-1]):
            return self
        table = torch.from_numpy(np.ascontiguousarray(self.rows[:, order]))
        return CopyBatch(table, table.numpy(), self.total_bytes)

    @cached_property
    def addresses(self) -> tuple[int, int, int]:
        """Where the source, destination and size rows start in memory (for the driver),
        worked out once per batch: numpy's ctypes pointer is slow to read (docs/transfer.md)."""
        rows = self.rows
        if rows.strides[1] != rows.itemsize:
            raise ValueError("a batch's rows must each be contiguous")
        base, step = int(rows.ctypes.data), int(rows.strides[0])
        return base, base + step, base + 2 * step

    @property
    def count(self) -> int:
        return int(self.rows.shape[1])

    @property
    def src(self) -> npt.NDArray[np.int64]:
        return self.rows[0]

    @property
    def dst(self) -> npt.NDArray[np.int64]:
        return self.rows[1]

    @property
    def sizes(self) -> npt.NDArray[np.int64]:
        return self.rows[2]

    @property
    def mean_copy_bytes(self) -> int:
        return self.total_bytes // self.count if self.count else 0
