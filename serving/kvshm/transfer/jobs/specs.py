"""The job description types of vLLM's offloading contract: block-id specs, tensor references,
results. Names and fields follow vLLM's, so its connector can use kvshm's handlers unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from kvshm.transfer.errors import InvalidTransferSpecError

GPU_MEDIUM = "GPU"
CPU_MEDIUM = "CPU"

BlockIds = npt.NDArray[np.int64]


def as_block_ids(block_ids: object, what: str) -> BlockIds:
    """A 1-D int64 array of block ids, or InvalidTransferSpecError saying what is wrong."""
    array = np.asarray(block_ids)
    if array.ndim != 1:
        raise InvalidTransferSpecError(
            f"{what} block ids must be 1-D, got an array of shape {array.shape}"
        )
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidTransferSpecError(
            f"{what} block ids must be integers, got dtype {array.dtype}"
        )
    return array.astype(np.int64, copy=False)


class BlockIDsLoadStoreSpec:
    """Where a job's blocks are on one medium: block ids at that medium's own granularity."""

    MEDIUM: ClassVar[str] = ""

    def __init__(self, block_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        self.block_ids: BlockIds = as_block_ids(block_ids, self.MEDIUM)

    @classmethod
    def medium(cls) -> str:
        return cls.MEDIUM

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the CPU region (one CPU block = block_size_factor GPU blocks)."""

    MEDIUM = CPU_MEDIUM


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of a job, group after group.

    group_sizes[g] is how many of block_ids belong to KV-cache group g (they come in group
    order); block_indices[g] is where group g starts in the request, in GPU blocks, which says
    how far into its first CPU block the group starts.
    """

    MEDIUM = GPU_MEDIUM

    def __init__(
        self,
        block_ids: Sequence[int] | npt.NDArray[np.integer],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes = tuple(int(size) for size in group_sizes)
        self.block_indices = tuple(int(index) for index in block_indices)

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes={list(self.group_sizes)}, "
            f"block_indices={list(self.block_indices)})"
        )


TransferSpec = tuple[BlockIDsLoadStoreSpec, BlockIDsLoadStoreSpec]
TransferType = tuple[str, str]


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """One tensor a KV-cache group uses: its index in the handler's tensor lists and the bytes
    of one GPU block of it to copy."""

    tensor_idx: int
    page_size_bytes: int


TensorRef = CanonicalKVCacheRef


@dataclass(frozen=True)
class TransferResult:
    """A finished job: vLLM's fields (transfer_size in bytes, transfer_time in seconds)."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = field(default=None)
