"""Building the backends one handler may use, with the reason for each one it may not."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvshm.transfer.backends.base import CopyBackend
from kvshm.transfer.backends.cpu import CpuMemmoveBackend
from kvshm.transfer.backends.cuda_driver import CopyDirection, cuda_driver
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend, triton_missing_reason, unmapped_reason
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.backends.strided import StridedBackend, strided_refusal
from kvshm.transfer.errors import BackendUnavailableError
from kvshm.transfer.options import TransferOptions
from kvshm.transfer.specs import CanonicalKVCacheRef
from kvshm.transfer.tensors import ALIGNMENT, TensorPairs
from kvshm.transfer.uniform import UniformLayout

log = logging.getLogger(__name__)

Backends = tuple[dict[str, CopyBackend], dict[str, str]]


def build_backends(
    pairs: TensorPairs,
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    gpu_to_cpu: bool,
    options: TransferOptions,
    staging: bool = False,
    layout: UniformLayout | None = None,
) -> Backends:
    """The usable backends by name, and why each other one cannot be used. `staging` builds
    the staged backend, which reserves its device buffers now; `layout` (the handler's
    uniform layout, if any) decides whether the strided backend can take its jobs."""
    reason: str | None
    gpu_backends = ("dma", "kernel", "staged", "strided")
    if pairs.device.type == "cpu":
        reason = "the 'GPU' tensors are CPU tensors"
        return {"cpu": CpuMemmoveBackend()}, dict.fromkeys(gpu_backends, reason)
    unavailable = {"cpu": f"the GPU tensors are on {pairs.device}, which memmove cannot reach"}
    if pairs.device.type != "cuda":
        reason = f"kvshm copies to CUDA devices only, not {pairs.device}"
        return {}, {**unavailable, **dict.fromkeys(gpu_backends, reason)}
    device_index = pairs.device.index
    if device_index is None:
        device_index = torch.cuda.current_device()
    try:
        driver = cuda_driver()
    except BackendUnavailableError as exc:
        return {}, {**unavailable, **dict.fromkeys(gpu_backends, str(exc))}
    dma = DmaBackend(
        driver,
        CopyDirection(gpu_to_cpu, device_index),
        options.descriptors_per_call,
        options.use_batch_call,
    )
    backends: dict[str, CopyBackend] = {"dma": dma}
    refusal = strided_refusal(layout)
    if refusal is not None:
        unavailable["strided"] = refusal
    elif layout is not None:
        backends["strided"] = StridedBackend(driver, dma, layout, gpu_to_cpu)
    torch.cuda.synchronize(device_index)  # binds the device's context to this thread
    reason = triton_missing_reason()
    if reason is None and not pairs.all_aligned(group_refs):
        reason = f"some address or page size is not a multiple of {ALIGNMENT} bytes"
    if reason is not None:
        return backends, {**unavailable, "kernel": reason, "staged": reason}
    device = torch.device("cuda", device_index)
    # staging runs the kernel on device memory only; the kernel backend (below) also needs the
    # region registered
    if staging and options.staging_buffers >= 2:
        # its gathers and scatters touch device memory only: a grid on every SM moves a
        # piece at ~1 TB/s (32 programs manage ~230 GB/s) and then leaves the SMs alone
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        device_copies = KernelBackend(device, options.kernel_chunk_bytes, programs=2 * sms)
        staged = StagedBackend(
            device,
            gpu_to_cpu,
            dma,
            device_copies,
            options.staging_buffer_bytes,
            options.staging_buffers,
        )
        try:
            staged.allocate()
            backends["staged"] = staged
        except torch.OutOfMemoryError as exc:
            # the engine has already claimed its KV cache: go on without staging rather than
            # fail to start
            unavailable["staged"] = (
                f"could not reserve {options.staging_buffers} x {options.staging_buffer_bytes} "
                f"bytes of GPU memory for staging ({exc}); lower staging_buffer_bytes or leave "
                f"the GPU that much room"
            )
            log.warning("copy backend staged not used: %s", unavailable["staged"])
    elif staging:
        unavailable["staged"] = f"staging_buffers is {options.staging_buffers}; it needs 2 or more"
    reason = unmapped_reason(driver, pairs.cpu)
    if reason is None:
        backends["kernel"] = KernelBackend(
            device, options.kernel_chunk_bytes, programs=options.kernel_programs
        )
    else:
        unavailable["kernel"] = reason
    return backends, unavailable
