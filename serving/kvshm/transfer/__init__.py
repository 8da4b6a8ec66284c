"""kvshm.transfer: moving KV blocks between GPU tensors and a shared region, in order, fast.

GPU-only pieces (CUDA streams, the driver, Triton) load on first use, so this package imports
and its CPU backend runs on machines without a GPU.
"""

from kvshm.transfer.choice.chooser import BACKEND_ENV, BackendPolicy
from kvshm.transfer.errors import (
    BackendUnavailableError,
    CudaCallError,
    HandlerClosedError,
    InvalidTensorsError,
    InvalidTransferSpecError,
    TransferError,
)
from kvshm.transfer.handler import SingleDirectionOffloadingHandler
from kvshm.transfer.jobs.pointers import compute_sub_block_ptrs
from kvshm.transfer.jobs.specs import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    TensorRef,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvshm.transfer.metrics import Direction
from kvshm.transfer.options import TransferOptions
from kvshm.transfer.pair import CpuGpuOffloadingHandlers

__all__ = [
    "BACKEND_ENV",
    "BackendPolicy",
    "BackendUnavailableError",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CanonicalKVCacheRef",
    "CpuGpuOffloadingHandlers",
    "CudaCallError",
    "Direction",
    "GPULoadStoreSpec",
    "HandlerClosedError",
    "InvalidTensorsError",
    "InvalidTransferSpecError",
    "SingleDirectionOffloadingHandler",
    "TensorRef",
    "TransferError",
    "TransferOptions",
    "TransferResult",
    "TransferSpec",
    "TransferType",
    "compute_sub_block_ptrs",
]
