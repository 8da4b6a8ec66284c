"""kvshm.transfer: moving KV blocks between GPU tensors and a shared region, in order, fast.

GPU-only pieces (CUDA streams, the driver, Triton) load on first use, so this package imports
and its CPU backend runs on machines without a GPU. The vLLM plugin uses what this face
hands on, and nothing behind it.
"""

from kvshm.transfer.assembly import HandlerAssembly, HandlerLayout, WorkerHandlers
from kvshm.transfer.backends.base import BackendName
from kvshm.transfer.calibration import ChoiceCache
from kvshm.transfer.choice.chooser import BACKEND_ENV, BACKEND_NAMES, COPY_ENGINES, BackendPolicy
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

__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAMES",
    "COPY_ENGINES",
    "BackendName",
    "BackendPolicy",
    "BackendUnavailableError",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CanonicalKVCacheRef",
    "ChoiceCache",
    "CudaCallError",
    "Direction",
    "GPULoadStoreSpec",
    "HandlerAssembly",
    "HandlerClosedError",
    "HandlerLayout",
    "InvalidTensorsError",
    "InvalidTransferSpecError",
    "SingleDirectionOffloadingHandler",
    "TensorRef",
    "TransferError",
    "TransferOptions",
    "TransferResult",
    "TransferSpec",
    "TransferType",
    "WorkerHandlers",
    "compute_sub_block_ptrs",
]
