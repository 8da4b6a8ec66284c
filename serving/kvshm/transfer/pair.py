"""Both directions for one set of GPU tensors and a shared region (vLLM's pair of handlers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshm.region import SharedOffloadRegion
from kvshm.transfer.choice.chooser import BackendPolicy
from kvshm.transfer.handler import SingleDirectionOffloadingHandler
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef
from kvshm.transfer.jobs.tensors import check_gpu_tensors
from kvshm.transfer.options import TransferOptions


class CpuGpuOffloadingHandlers:
    """A GPU->CPU and a CPU->GPU handler over the same tensors.

    The CPU tensors are this worker's views of the region: one create_next_view per GPU tensor,
    of the GPU block size x block_size_factor bytes, in order. With pin=True a region not yet
    registered with CUDA is pinned first (a failure only warns: copies still work, slower).
    """

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        region: SharedOffloadRegion,
        block_size_factor: int,
        kv_cache_groups_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        *,
        pin: bool = True,
        backend: str | None = None,
        options: TransferOptions | None = None,
        policy: BackendPolicy | None = None,
    ) -> None:
        device = check_gpu_tensors(gpu_tensors)
        if pin and device.type == "cuda" and not region.is_pinned:
            region.pin()
        self.region = region
        self.gpu_tensors = list(gpu_tensors)
        self.cpu_tensors = [
            region.create_next_view(tensor.shape[1] * block_size_factor) for tensor in gpu_tensors
        ]
        common = dict(backend=backend, options=options, policy=policy)
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            gpu_tensors,
            self.cpu_tensors,
            block_size_factor,
            kv_cache_groups_data_refs,
            gpu_to_cpu=True,
            **common,  # type: ignore[arg-type]
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            gpu_tensors,
            self.cpu_tensors,
            block_size_factor,
            kv_cache_groups_data_refs,
            gpu_to_cpu=False,
            **common,  # type: ignore[arg-type]
        )

    def shutdown(self) -> None:
        """Wait for and release both handlers; the region itself stays the caller's."""
        self.gpu_to_cpu_handler.shutdown()
        self.cpu_to_gpu_handler.shutdown()
