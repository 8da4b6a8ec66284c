"""Building the backends one handler may use, with the reason for each one it may not."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.backends.cpu import CpuMemmoveBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend, triton_missing_reason, unmapped_reason
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.backends.strided import StridedBackend, strided_refusal
from kvshm.transfer.cuda.driver import CopyDirection, cuda_driver
from kvshm.transfer.errors import BackendUnavailableError
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef
from kvshm.transfer.jobs.tensors import ALIGNMENT, TensorPairs
from kvshm.transfer.jobs.uniform import UniformLayout
from kvshm.transfer.options import TransferOptions

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
    gpu_backends: tuple[str, ...] = (
        BackendName.DMA,
        BackendName.KERNEL,
        BackendName.STAGED,
        BackendName.STRIDED,
    )
    if pairs.device.type == "cpu":
        reason = "the 'GPU' tensors are CPU tensors"
        return {BackendName.CPU: CpuMemmoveBackend()}, dict.fromkeys(gpu_backends, reason)
    unavailable: dict[str, str] = {
        BackendName.CPU: f"the GPU tensors are on {pairs.device}, which memmove cannot reach"
    }
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
    backends: dict[str, CopyBackend] = {BackendName.DMA: dma}
    refusal = strided_refusal(layout)
    if refusal is not None:
        unavailable[BackendName.STRIDED] = refusal
    elif layout is not None:
        backends[BackendName.STRIDED] = StridedBackend(driver, dma, gpu_to_cpu)
    torch.cuda.synchronize(device_index)  # binds the device's context to this thread
    reason = triton_missing_reason()
    if reason is None and not pairs.all_aligned(group_refs):
        reason = f"some address or page size is not a multiple of {ALIGNMENT} bytes"
    if reason is not None:
        return backends, {**unavailable, BackendName.KERNEL: reason, BackendName.STAGED: reason}
    device = torch.device("cuda", device_index)
    # staging runs the kernel on device memory only; the kernel backend (below) also needs the
    # region registered
    if staging and options.staging_buffers >= 2:
        # its gathers and scatters touch device memory only: a grid on every SM finishes a
        # piece far sooner than 32 programs, then leaves the SMs alone (docs/transfer.md)
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
            backends[BackendName.STAGED] = staged
        except torch.OutOfMemoryError as exc:
            # the engine has already claimed its KV cache: go on without staging rather than
            # fail to start
            unavailable[BackendName.STAGED] = (
                f"could not reserve {options.staging_buffers} x {options.staging_buffer_bytes} "
                f"bytes of GPU memory for staging ({exc}); lower staging_buffer_bytes or leave "
                f"the GPU that much room"
            )
            log.warning("copy backend staged not used: %s", unavailable[BackendName.STAGED])
    elif staging:
        unavailable[BackendName.STAGED] = (
            f"staging_buffers is {options.staging_buffers}; it needs 2 or more"
        )
    reason = unmapped_reason(driver, pairs.cpu)
    if reason is None:
        backends[BackendName.KERNEL] = KernelBackend(
            device, options.kernel_chunk_bytes, programs=options.kernel_programs
        )
    else:
        unavailable[BackendName.KERNEL] = reason
    return backends, unavailable
