"""Checking the tensors and group references a handler is built from, once, with clear errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvshm.transfer.errors import InvalidTensorsError, InvalidTransferSpecError
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef

ALIGNMENT = 16  # bytes the copy kernel moves per access


@dataclass(frozen=True)
class TensorPairs:
    """Matching GPU and CPU block tensors, as byte geometries, and the GPU side's device."""

    gpu: list[RowGeometry]
    cpu: list[RowGeometry]
    device: torch.device
    block_size_factor: int

    def all_aligned(self, group_refs: Sequence[Sequence[CanonicalKVCacheRef]]) -> bool:
        """Whether every address and size a job can produce is a multiple of ALIGNMENT."""
        geometries = [*self.gpu, *self.cpu]
        if any(g.base % ALIGNMENT or g.row_stride % ALIGNMENT for g in geometries):
            return False
        if any(g.row_width % ALIGNMENT for g in self.gpu):
            return False  # the CPU sub-block width equals the GPU row width
        return all(ref.page_size_bytes % ALIGNMENT == 0 for refs in group_refs for ref in refs)


def _check_block_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorsError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int8:
        raise InvalidTensorsError(
            f"{what} must have dtype int8 (view the KV cache as bytes with "
            f".view(torch.int8)), got {tensor.dtype}"
        )
    if tensor.dim() != 2:
        raise InvalidTensorsError(
            f"{what} must be 2-D (blocks, bytes per block), got shape {tuple(tensor.shape)}"
        )
    return tensor


def check_gpu_tensors(gpu_tensors: Sequence[torch.Tensor]) -> torch.device:
    """Every GPU tensor is an int8 2-D tensor on one device; returns that device."""
    if not isinstance(gpu_tensors, Sequence) or len(gpu_tensors) == 0:
        raise InvalidTensorsError("gpu_tensors must be a non-empty list of tensors")
    devices = {
        _check_block_tensor(t, f"gpu_tensors[{i}]").device for i, t in enumerate(gpu_tensors)
    }
    if len(devices) != 1:
        raise InvalidTensorsError(
            f"all GPU tensors must be on one device, got {sorted(str(d) for d in devices)}"
        )
    return devices.pop()


def check_tensors(
    gpu_tensors: Sequence[torch.Tensor],
    cpu_tensors: Sequence[torch.Tensor],
    block_size_factor: int,
) -> TensorPairs:
    if isinstance(block_size_factor, bool) or not isinstance(block_size_factor, int):
        raise InvalidTensorsError(f"blocks_per_chunk must be an integer, got {block_size_factor!r}")
    if block_size_factor < 1:
        raise InvalidTensorsError(f"blocks_per_chunk must be >= 1, got {block_size_factor}")
    device = check_gpu_tensors(gpu_tensors)
    if not isinstance(cpu_tensors, Sequence) or len(cpu_tensors) != len(gpu_tensors):
        given = len(cpu_tensors) if isinstance(cpu_tensors, Sequence) else cpu_tensors
        raise InvalidTensorsError(
            f"cpu_tensors must match gpu_tensors one to one: {len(gpu_tensors)} GPU tensors, "
            f"got {given!r} CPU tensors"
        )
    gpu, cpu = [], []
    for i, (gpu_tensor, cpu_tensor) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
        _check_block_tensor(cpu_tensor, f"cpu_tensors[{i}]")
        if cpu_tensor.device.type != "cpu":
            raise InvalidTensorsError(
                f"cpu_tensors[{i}] must be in CPU memory, got device {cpu_tensor.device}"
            )
        if cpu_tensor.shape[1] != gpu_tensor.shape[1] * block_size_factor:
            raise InvalidTensorsError(
                f"cpu_tensors[{i}] has {cpu_tensor.shape[1]}-byte blocks but GPU blocks of "
                f"{gpu_tensor.shape[1]} bytes x blocks_per_chunk {block_size_factor} need "
                f"{gpu_tensor.shape[1] * block_size_factor}"
            )
        try:
            gpu.append(RowGeometry.of(gpu_tensor))
            cpu.append(RowGeometry.of(cpu_tensor))
        except InvalidTransferSpecError as exc:
            raise InvalidTensorsError(f"tensor pair {i}: {exc}") from exc
    return TensorPairs(gpu, cpu, device, block_size_factor)


def check_group_refs(
    group_refs: Sequence[Sequence[CanonicalKVCacheRef | tuple[int, int]]], pairs: TensorPairs
) -> list[list[CanonicalKVCacheRef]]:
    """Per group, its (tensor index, page size) references, checked against the tensors."""
    if not isinstance(group_refs, Sequence) or len(group_refs) == 0:
        raise InvalidTensorsError(
            "layer_refs_per_group must list, per KV-cache group, the tensors it uses"
        )
    checked: list[list[CanonicalKVCacheRef]] = []
    for g, refs in enumerate(group_refs):
        if not isinstance(refs, Sequence):
            raise InvalidTensorsError(f"group {g}'s references must be a list, got {refs!r}")
        group = []
        for ref in refs:
            if isinstance(ref, tuple):
                ref = CanonicalKVCacheRef(*ref)
            index, page = ref.tensor_idx, ref.page_size_bytes
            if not isinstance(index, int) or not 0 <= index < len(pairs.gpu):
                raise InvalidTensorsError(
                    f"group {g} refers to tensor {index!r}, but there are {len(pairs.gpu)} tensors"
                )
            width = pairs.gpu[index].row_width
            if not isinstance(page, int) or not 0 < page <= width:
                raise InvalidTensorsError(
                    f"group {g}: page_size_bytes of tensor {index} must be in (0, {width}] "
                    f"(its GPU block size), got {page!r}"
                )
            group.append(ref)
        checked.append(group)
    return checked
