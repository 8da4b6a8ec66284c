"""The CPU backend: memmove by address. It runs every pointer, ordering and result path of the
handler without a GPU, so CI checks them byte for byte."""

from __future__ import annotations

import ctypes

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.work import Stream


class CpuMemmoveBackend(CopyBackend):
    name = BackendName.CPU

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> None:
        for src, dst, size in zip(*batch.rows.tolist(), strict=True):
            ctypes.memmove(dst, src, size)  # releases the GIL for the copy itself
