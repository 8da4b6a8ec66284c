"""The one interface every copy backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import ClassVar

from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.uniform import UniformJob, UniformLayout
from kvshm.transfer.jobs.work import Stream


class BackendName(StrEnum):
    """The copy backends by name: the plugin's kvshm_transfer_backend, KVSHM_TRANSFER_BACKEND,
    the calibration cache's keys and the kvshm_transfer_jobs_total{backend} label."""

    DMA = "dma"  # the copy engines, one descriptor a page (cuMemcpyBatchAsync)
    KERNEL = "kernel"  # a Triton copy kernel on the SMs
    STAGED = "staged"  # pages gathered into pinned staging buffers, large descriptors
    STRIDED = "strided"  # one 2-D copy a block where the layout's rows allow
    CPU = "cpu"  # memmove, where there is no CUDA


class CopyBackend(ABC):
    """Issues a batch of (source, destination, size) copies on a stream.

    copy() may return an object that must stay alive until the copies are done (a device
    copy of the descriptors, say); the caller keeps it until then, and releases it then if it
    is a Lease. `after` is the stream whose queued work GPU->CPU copies must follow: `stream`
    already waits for it, so only a backend that issues on other streams too needs it.

    A backend may also take uniform jobs (kvshm.transfer.jobs.uniform), their tables from the block
    ids alone: prepare_uniform(layout) once when the handler is built, then copy_uniform(job)
    per job, which returns what copy() does.
    """

    name: ClassVar[BackendName]

    @abstractmethod
    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> object: ...

    def prepare_uniform(self, layout: UniformLayout) -> str | None:
        """Take the handler's uniform layout; returns why this backend cannot take its
        uniform jobs, or None where copy_uniform then takes them."""
        return f"the {self.name} backend takes no uniform jobs"

    def copy_uniform(self, job: UniformJob, stream: Stream, after: Stream | None = None) -> object:
        """One uniform job of the layout prepare_uniform accepted."""
        raise ValueError(f"the {self.name} backend takes no uniform jobs")
