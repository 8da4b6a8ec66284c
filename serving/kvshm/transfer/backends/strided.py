"""The strided backend: one 2-D copy per block by the copy engines, for a layer-outer KV cache
in one allocation.

vLLM 0.33 allocates a worker's KV cache once. Layer-outer, layer l's page of block b lies at
offset + l * layer_stride + b * page, and the block's cell in the region holds the pages back to
back, so one cuMemcpy2DAsync (a row per layer: the page, GPU pitch layer_stride, host pitch the
page) moves a block. A 16-block job is 16 driver calls where a descriptor per page is 16 x
layers, and no SM touches the bytes: the model's compute beside loses what it loses beside DMA.
But the copy engines move such rows at less of the link than staging does (docs/transfer.md):
so this backend is taken by name, or measured among the backends that use no SMs (the plugin's
kvshm_backend: copy-engines), where the model's compute matters more than the last tenth of the
link; the default calibration leaves it out. Jobs that are not uniform
(kvshm.transfer.jobs.uniform) go by DMA.
"""

from __future__ import annotations

import numpy as np

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.cuda.driver import CUDA_MEMCPY2D, CUDA_SUCCESS, CudaDriver
from kvshm.transfer.errors import CudaCallError
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.uniform import UniformJob, UniformLayout
from kvshm.transfer.jobs.work import Stream


def strided_refusal(layout: UniformLayout | None) -> str | None:
    """Why the strided backend cannot take this layout, or None."""
    if layout is None:
        return "a block is not one run of the region (several groups or blocks_per_chunk > 1)"
    if layout.layer_pitch() is None:
        return (
            "a block's pages do not lie at one stride in one GPU allocation, each filling its "
            "place in the cell in turn (vLLM 0.33's layer-outer cache does)"
        )
    return None


class StridedBackend(CopyBackend):
    name = BackendName.STRIDED

    def __init__(self, driver: CudaDriver, dma: DmaBackend, gpu_to_cpu: bool) -> None:
        self._driver = driver
        self._dma = dma
        self._gpu_to_cpu = gpu_to_cpu
        self._prepared: tuple[UniformLayout, CUDA_MEMCPY2D] | None = None

    def prepare_uniform(self, layout: UniformLayout) -> str | None:
        """Take the handler's uniform layout where one 2-D copy moves its block, else say why
        not (strided_refusal)."""
        pitch = layout.layer_pitch()
        if pitch is None:
            return strided_refusal(layout)
        page = int(layout.page[0])
        params = CUDA_MEMCPY2D.rows(page, layout.refs)
        # GPU rows a layer apart, host rows a page apart (the cell's pages back to back)
        params.srcPitch, params.dstPitch = (pitch, page) if self._gpu_to_cpu else (page, pitch)
        self._prepared = (layout, params)
        return None

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> None:
        self._dma.copy(batch, stream, after)

    def copy_uniform(self, job: UniformJob, stream: Stream, after: Stream | None = None) -> None:
        """One 2-D copy per block of a job of the prepared layout."""
        if self._prepared is None:
            raise ValueError("copy_uniform before prepare_uniform")
        layout, params = self._prepared
        gpu = layout.gpu_base[0] + job.gpu_ids * layout.gpu_stride[0]
        cells = layout.cpu_base + job.cpu_ids * layout.cpu_stride
        if self._gpu_to_cpu:
            order = np.argsort(cells, kind="stable")  # host memory takes writes in order
            sources, destinations = gpu[order], cells[order]
        else:
            sources, destinations = cells, gpu
        handle, copy_2d = int(stream.cuda_stream), self._driver.memcpy_2d
        for source, destination in zip(sources.tolist(), destinations.tolist(), strict=True):
            params.srcDevice, params.dstDevice = source, destination
            code = copy_2d(params, handle)
            if code != CUDA_SUCCESS:
                raise CudaCallError("cuMemcpy2DAsync", code)
