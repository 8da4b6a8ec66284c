"""Building the backends one handler may use, with the reason for each one it may not."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshm.transfer.backends.base import CopyBackend
from kvshm.transfer.backends.cpu import CpuMemmoveBackend
from kvshm.transfer.backends.cuda_driver import CopyDirection, cuda_driver
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend, triton_missing_reason, unmapped_reason
from kvshm.transfer.errors import BackendUnavailableError
from kvshm.transfer.options import TransferOptions
from kvshm.transfer.specs import CanonicalKVCacheRef
from kvshm.transfer.tensors import ALIGNMENT, TensorPairs

Backends = tuple[dict[str, CopyBackend], dict[str, str]]


def build_backends(
    pairs: TensorPairs,
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    gpu_to_cpu: bool,
    options: TransferOptions,
) -> Backends:
    """The usable backends by name, and why each other one cannot be used."""
    reason: str | None
    if pairs.device.type == "cpu":
        reason = "the 'GPU' tensors are CPU tensors"
        return {"cpu": CpuMemmoveBackend()}, {"dma": reason, "kernel": reason}
    unavailable = {"cpu": f"the GPU tensors are on {pairs.device}, which memmove cannot reach"}
    if pairs.device.type != "cuda":
        reason = f"kvshm copies to CUDA devices only, not {pairs.device}"
        return {}, {**unavailable, "dma": reason, "kernel": reason}
    device_index = pairs.device.index
    if device_index is None:
        device_index = torch.cuda.current_device()
    try:
        driver = cuda_driver()
    except BackendUnavailableError as exc:
        return {}, {**unavailable, "dma": str(exc), "kernel": str(exc)}
    backends: dict[str, CopyBackend] = {
        "dma": DmaBackend(
            driver,
            CopyDirection(gpu_to_cpu, device_index),
            options.descriptors_per_call,
            options.use_batch_call,
        )
    }
    torch.cuda.synchronize(device_index)  # binds the device's context to this thread
    reason = triton_missing_reason()
    if reason is None and not pairs.all_aligned(group_refs):
        reason = f"some address or page size is not a multiple of {ALIGNMENT} bytes"
    if reason is None:
        reason = unmapped_reason(driver, pairs.cpu)
    if reason is None:
        device = torch.device("cuda", device_index)
        backends["kernel"] = KernelBackend(
            device, options.kernel_chunk_bytes, programs_per_sm=options.kernel_programs_per_sm
        )
    else:
        unavailable["kernel"] = reason
    return backends, unavailable
