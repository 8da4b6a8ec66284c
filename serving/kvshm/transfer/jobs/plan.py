"""Turning a job's (source, destination) specs into its copies, validating everything first.

Per KV-cache group g (vLLM 0.33's transfer_async): the GPU side uses group_sizes[g] ids; the CPU
side may start mid-block, skip = block_indices[g] mod factor, and uses ceil((size + skip) / factor)
ids. Every (group, tensor ref) adds group_sizes[g] copies of the ref's page size. All ids of
both sides must be used exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvshm.transfer.errors import InvalidTransferSpecError
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.pointers import (
    RowGeometry,
    blocks_spanned,
    check_ids_in_range,
    fill_sub_block_ptrs,
)
from kvshm.transfer.jobs.specs import BlockIds, CanonicalKVCacheRef, as_block_ids


@dataclass(frozen=True)
class GpuSide:
    """A job's GPU spec, read from kvshm's or vLLM's GPULoadStoreSpec."""

    block_ids: BlockIds
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


@dataclass(frozen=True)
class CpuSide:
    block_ids: BlockIds


def _is_block_ids(spec: object) -> bool:
    return hasattr(spec, "block_ids")


def _is_gpu_side(spec: object) -> bool:
    return _is_block_ids(spec) and hasattr(spec, "group_sizes") and hasattr(spec, "block_indices")


@dataclass(frozen=True)
class GroupGeometry:
    """Per tensor ref of one group, as (1, refs) arrays: a job fills all refs' copies in one
    numpy pass."""

    gpu_base: npt.NDArray[np.int64]
    gpu_stride: npt.NDArray[np.int64]
    cpu_base: npt.NDArray[np.int64]
    cpu_stride: npt.NDArray[np.int64]
    cpu_sub_block: npt.NDArray[np.int64]
    page: npt.NDArray[np.int64]
    block_bytes: int
    """Bytes one block of the group moves: the sum of its refs' pages."""

    @classmethod
    def of(
        cls,
        refs: Sequence[CanonicalKVCacheRef],
        gpu: Sequence[RowGeometry],
        cpu: Sequence[RowGeometry],
        factor: int,
    ) -> GroupGeometry:
        def row(values: list[int]) -> npt.NDArray[np.int64]:
            return np.array(values, dtype=np.int64)[None, :]

        # in the order of their CPU views in the cell, so that one block's pages come out in
        # address order: where the views lie back to back, each block is one run of memory
        ordered = sorted(refs, key=lambda r: cpu[r.tensor_idx].base)
        g = [gpu[r.tensor_idx] for r in ordered]
        c = [cpu[r.tensor_idx] for r in ordered]
        return cls(
            gpu_base=row([x.base for x in g]),
            gpu_stride=row([x.row_stride for x in g]),
            cpu_base=row([x.base for x in c]),
            cpu_stride=row([x.row_stride for x in c]),
            cpu_sub_block=row([x.row_width // factor for x in c]),
            page=row([r.page_size_bytes for r in ordered]),
            block_bytes=sum(r.page_size_bytes for r in ordered),
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
        self._geometries = [
            GroupGeometry.of(refs, self._gpu, self._cpu, block_size_factor) for refs in self._groups
        ]
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
        for part, geometry in zip(slices, self._geometries, strict=True):
            n = part.gpu_count
            if n == 0:
                continue
            refs = geometry.page.shape[1]
            gpu_ids = gpu_spec.block_ids[part.gpu_start : part.gpu_start + n]
            cpu_ids = cpu_spec.block_ids[part.cpu_start : part.cpu_start + part.cpu_count]
            rows = batch.rows[:, at : at + refs * n].reshape(3, n, refs)
            # copy (k, r): ref r's page of the group's k-th GPU block, and where it sits in its
            # CPU block, for every ref at once; block by block, so each block's pages stay
            # together
            g = geometry
            fill_sub_block_ptrs(gpu_ids, 1, rows[gpu_row], g.gpu_base, g.gpu_stride, 0, 0)
            fill_sub_block_ptrs(
                cpu_ids,
                self._factor,
                rows[cpu_row],
                g.cpu_base,
                g.cpu_stride,
                g.cpu_sub_block,
                part.skip,
            )
            rows[2] = geometry.page
            total += n * geometry.block_bytes
            at += refs * n
        return batch.with_total(total)

    def _unpack(self, spec: object) -> tuple[GpuSide, CpuSide]:
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise InvalidTransferSpecError(
                f"a transfer spec is a (source spec, destination spec) pair, got {spec!r}"
            )
        src, dst = spec
        gpu, cpu = (src, dst) if self._gpu_to_cpu else (dst, src)
        # kvshm's spec classes or vLLM's (GPULoadStoreSpec, CPULoadStoreSpec): by their fields
        if not _is_gpu_side(gpu) or not _is_block_ids(cpu) or _is_gpu_side(cpu):
            want = "(GPU spec, CPU spec)" if self._gpu_to_cpu else "(CPU spec, GPU spec)"
            raise InvalidTransferSpecError(
                f"this handler moves {'GPU->CPU' if self._gpu_to_cpu else 'CPU->GPU'} and takes "
                f"{want} (a GPU spec has block_ids, group_sizes and block_indices; a CPU spec "
                f"block_ids only), got ({type(src).__name__}, {type(dst).__name__})"
            )
        gpu_side = GpuSide(
            as_block_ids(gpu.block_ids, "GPU"),
            tuple(int(size) for size in gpu.group_sizes),
            tuple(int(index) for index in gpu.block_indices),
        )
        return gpu_side, CpuSide(as_block_ids(cpu.block_ids, "CPU"))

    def _slice_groups(self, gpu_spec: GpuSide, cpu_spec: CpuSide) -> list[GroupSlice]:
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
