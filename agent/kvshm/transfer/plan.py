"""Turning a job's (source, destination) specs into its copies, validating everything first.

Per KV-cache group g (SEMANTICS §4): the GPU side uses group_sizes[g] ids; the CPU side may
start mid-block, skip = block_indices[g] mod factor, and uses ceil((size + skip) / factor)
ids. Every (group, tensor ref) adds group_sizes[g] copies of the ref's page size. All ids of
both sides must be used exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvshm.transfer.batch import CopyBatch
from kvshm.transfer.errors import InvalidTransferSpecError
from kvshm.transfer.pointers import (
    RowGeometry,
    blocks_spanned,
    check_ids_in_range,
    fill_sub_block_ptrs,
)
from kvshm.transfer.specs import (
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
)


@dataclass(frozen=True)
class GroupSlice:
    """Which ids of each side one group uses, and how far into its first CPU block it starts."""

    gpu_start: int
    gpu_count: int
    cpu_start: int
    cpu_count: int
    skip: int


class JobPlanner:
    """Builds the copy table of a job for one direction of one set of tensors."""

    def __init__(
        self,
        gpu_geometries: Sequence[RowGeometry],
        cpu_geometries: Sequence[RowGeometry],
        block_size_factor: int,
        group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
    ) -> None:
        self._gpu = list(gpu_geometries)
        self._cpu = list(cpu_geometries)
        self._factor = block_size_factor
        self._groups = [list(refs) for refs in group_refs]
        self._gpu_to_cpu = gpu_to_cpu
        used = {ref.tensor_idx for refs in self._groups for ref in refs}
        self._gpu_rows = min((self._gpu[i].num_rows for i in used), default=0)
        self._cpu_rows = min((self._cpu[i].num_rows for i in used), default=0)

    def plan(self, spec: object) -> CopyBatch:
        gpu_spec, cpu_spec = self._unpack(spec)
        slices = self._slice_groups(gpu_spec, cpu_spec)
        check_ids_in_range(gpu_spec.block_ids, self._gpu_rows, "GPU")
        check_ids_in_range(cpu_spec.block_ids, self._cpu_rows, "CPU")
        count = sum(s.gpu_count * len(refs) for s, refs in zip(slices, self._groups, strict=True))
        batch = CopyBatch.allocate(count)
        gpu_row, cpu_row = (0, 1) if self._gpu_to_cpu else (1, 0)
        total = 0
        at = 0
        for part, refs in zip(slices, self._groups, strict=True):
            if part.gpu_count == 0:
                continue
            gpu_ids = gpu_spec.block_ids[part.gpu_start : part.gpu_start + part.gpu_count]
            cpu_ids = cpu_spec.block_ids[part.cpu_start : part.cpu_start + part.cpu_count]
            for ref in refs:
                end = at + part.gpu_count
                fill_sub_block_ptrs(
                    gpu_ids, 1, batch.rows[gpu_row, at:end], self._gpu[ref.tensor_idx], 0
                )
                fill_sub_block_ptrs(
                    cpu_ids,
                    self._factor,
                    batch.rows[cpu_row, at:end],
                    self._cpu[ref.tensor_idx],
                    part.skip,
                )
                batch.rows[2, at:end] = ref.page_size_bytes
                total += part.gpu_count * ref.page_size_bytes
                at = end
        return batch.with_total(total)

    def _unpack(self, spec: object) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise InvalidTransferSpecError(
                f"a transfer spec is a (source spec, destination spec) pair, got {spec!r}"
            )
        src, dst = spec
        gpu, cpu = (src, dst) if self._gpu_to_cpu else (dst, src)
        if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, CPULoadStoreSpec):
            want = "(GPULoadStoreSpec, CPULoadStoreSpec)"
            if not self._gpu_to_cpu:
                want = "(CPULoadStoreSpec, GPULoadStoreSpec)"
            raise InvalidTransferSpecError(
                f"this handler moves {'GPU->CPU' if self._gpu_to_cpu else 'CPU->GPU'} and takes "
                f"{want}, got ({type(src).__name__}, {type(dst).__name__})"
            )
        return gpu, cpu

    def _slice_groups(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec
    ) -> list[GroupSlice]:
        groups = len(self._groups)
        sizes, starts = gpu_spec.group_sizes, gpu_spec.block_indices
        if len(sizes) != groups or len(starts) != groups:
            raise InvalidTransferSpecError(
                f"the handler has {groups} KV-cache groups but the GPU spec gives "
                f"{len(sizes)} group sizes and {len(starts)} block indices: give one of each "
                f"per group"
            )
        if any(size < 0 for size in sizes) or any(start < 0 for start in starts):
            raise InvalidTransferSpecError(
                f"group sizes and block indices must be >= 0, got sizes {list(sizes)} and "
                f"block indices {list(starts)}"
            )
        slices = []
        gpu_at = cpu_at = 0
        for size, start in zip(sizes, starts, strict=True):
            skip = start % self._factor
            cpu_count = blocks_spanned(size, self._factor, skip)
            slices.append(GroupSlice(gpu_at, size, cpu_at, cpu_count, skip))
            gpu_at += size
            cpu_at += cpu_count
        self._check_all_used("GPU", gpu_at, len(gpu_spec.block_ids), sizes, starts)
        self._check_all_used("CPU", cpu_at, len(cpu_spec.block_ids), sizes, starts)
        return slices

    def _check_all_used(
        self, side: str, needed: int, given: int, sizes: Sequence[int], starts: Sequence[int]
    ) -> None:
        if needed != given:
            raise InvalidTransferSpecError(
                f"the groups (sizes {list(sizes)}, block indices {list(starts)}, "
                f"block_size_factor {self._factor}) use {needed} {side} block ids but the "
                f"{side} spec has {given}: every id of both sides must be used exactly once"
            )
