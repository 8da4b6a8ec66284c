"""The DMA backend: the GPU's copy engines, driven by cuMemcpyBatchAsync in chunks.

One call for a whole job blocks the CPU while the driver walks every descriptor, and the copy
engines idle meanwhile (docs/transfer.md); chunks of a few hundred descriptors let the
engines start on the first chunk while the next is issued.
Where the batch call is missing (CUDA < 12.8) or refuses the stream, each copy is issued with
cuMemcpyAsync instead.
"""

from __future__ import annotations

import logging

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.cuda.driver import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_SUCCESS,
    CopyDirection,
    CudaDriver,
)
from kvshm.transfer.errors import CudaCallError
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.uniform import UniformCopies, UniformJob, UniformLayout
from kvshm.transfer.jobs.work import Stream
from kvshm.transfer.options import DEFAULT_DESCRIPTORS_PER_CALL

log = logging.getLogger(__name__)

_WORD = 8  # bytes per descriptor entry (uint64)
# below this mean size, stores go in ascending host address; from it, every job goes in
# ascending GPU address (docs/transfer.md)
SORT_BELOW_BYTES = 256 * 1024


def issue_order(batch: CopyBatch, gpu_to_cpu: bool) -> CopyBatch:
    """The batch's copies in the order the copy engines take them fastest."""
    if batch.mean_copy_bytes < SORT_BELOW_BYTES:
        # host memory takes writes faster in ascending address order; reads do not care
        return batch.sorted_by_destination() if gpu_to_cpu else batch
    # large pages in the planner's order put a block's pages, back to back in its cell, one
    # after another; in GPU address order (tensor by tensor) consecutive copies go to
    # different cells, which moves more both ways at once
    return batch.sorted_by(0 if gpu_to_cpu else 1)


class DmaBackend(CopyBackend):
    name = BackendName.DMA

    def __init__(
        self,
        driver: CudaDriver,
        direction: CopyDirection,
        descriptors_per_call: int = DEFAULT_DESCRIPTORS_PER_CALL,
        use_batch: bool = True,
    ) -> None:
        if descriptors_per_call < 1:
            raise ValueError(f"descriptors_per_call must be >= 1, got {descriptors_per_call}")
        self._driver = driver
        self._attributes = direction.attributes()
        self._per_call = descriptors_per_call
        self.uses_batch = use_batch and driver.has_batch
        self._gpu_to_cpu = direction.gpu_to_cpu
        self._device_index = direction.device_index
        self._uniform: UniformCopies | None = None

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> None:
        self.issue(issue_order(batch, self._gpu_to_cpu), stream)

    def prepare_uniform(self, layout: UniformLayout) -> None:
        """Take the handler's uniform layout, any: its jobs' tables then come from their ids
        (copy_uniform), in the order copy() gives the planner's."""
        by_gpu_address = layout.mean_page_bytes >= SORT_BELOW_BYTES
        self._uniform = UniformCopies(layout, self._gpu_to_cpu, by_gpu_address)

    def copy_uniform(self, job: UniformJob, stream: Stream, after: Stream | None = None) -> None:
        if self._uniform is None:
            raise ValueError("copy_uniform before prepare_uniform")
        self.issue(self._uniform.batch(job), stream)

    def issue(self, batch: CopyBatch, stream: Stream) -> None:
        """The copies in the batch's order (copy() may reorder them first): the staged
        backend's runs, whole cells between a buffer and the region, are few and long, and
        already in buffer order."""
        handle = int(stream.cuda_stream)
        if self.uses_batch and self._copy_batched(batch, handle):
            return
        self._copy_each(batch, handle)

    def _copy_batched(self, batch: CopyBatch, stream: int) -> bool:
        """Issue the batch in chunks; False if the driver refused the very first call."""
        src, dst, sizes = batch.addresses
        for start in range(0, batch.count, self._per_call):
            count = min(self._per_call, batch.count - start)
            offset = start * _WORD
            call = (dst + offset, src + offset, sizes + offset, count, self._attributes, stream)
            code = self._driver.memcpy_batch(*call)
            if code == CUDA_ERROR_INVALID_VALUE and start == 0 and self._made_context_current():
                code = self._driver.memcpy_batch(*call)
            if code == CUDA_SUCCESS:
                continue
            if start == 0 and code in (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED):
                log.warning(
                    "cuMemcpyBatchAsync refused this stream (CUDA error %d); issuing copies "
                    "one by one from now on",
                    code,
                )
                self.uses_batch = False
                return False
            raise CudaCallError("cuMemcpyBatchAsync", code)
        return True

    def _made_context_current(self) -> bool:
        """On a thread with no CUDA context current the batch call refuses every stream
        (CUDA_ERROR_INVALID_VALUE) while cuMemcpyAsync, which takes the stream's context, works
        at a fraction of the speed (docs/transfer.md): make the device's primary context
        current there (as torch does) and say whether it was missing."""
        if self._driver.has_current_context():
            return False
        import torch

        torch.cuda.set_device(self._device_index)
        return True

    def _copy_each(self, batch: CopyBatch, stream: int) -> None:
        memcpy = self._driver.memcpy
        for src, dst, size in zip(*batch.rows.tolist(), strict=True):
            code = memcpy(dst, src, size, stream)
            if code != CUDA_SUCCESS:
                raise CudaCallError("cuMemcpyAsync", code)
