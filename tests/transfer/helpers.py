"""Shared test helpers: regions in a temporary directory, where a job's bytes must land,
synthetic tensor views (addresses only) of one group, and work on a thread with no CUDA
context."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvshm.region import RegionFormat, RegionLayout, SharedOffloadRegion
from kvshm.transfer import CanonicalKVCacheRef
from kvshm.transfer.jobs.pointers import RowGeometry

GPU_ROWS = 48
CPU_ROWS = 64


def gpu_views(pages: list[int]) -> list[RowGeometry]:
    """Tensor t at 2**40 + t * 2**32, GPU_ROWS blocks of its page."""
    return [
        RowGeometry((1 << 40) + (t << 32), page, page, GPU_ROWS) for t, page in enumerate(pages)
    ]


def cpu_views(pages: list[int], stride: int, base: int = 1 << 30) -> list[RowGeometry]:
    """The tensors' pages back to back in a cell, CPU_ROWS rows of `stride` bytes."""
    offsets = np.cumsum([0, *pages[:-1]])
    return [
        RowGeometry(base + int(o), stride, p, CPU_ROWS) for o, p in zip(offsets, pages, strict=True)
    ]


def one_group(pages: list[int]) -> list[list[CanonicalKVCacheRef]]:
    return [[CanonicalKVCacheRef(t, page) for t, page in enumerate(pages)]]


def unpadded(num_blocks: int, cpu_page_size: int, num_workers: int) -> RegionLayout:
    """These tests' tiny cells keep rows of exactly the cells (no 4096-byte padding)."""
    return RegionLayout(num_blocks, cpu_page_size, num_workers, RegionFormat.UNPADDED)


def open_region(
    directory: str, layout: RegionLayout, rank: int | None, *, instance_id: str | None = None
) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        instance_id or f"t-{uuid.uuid4().hex[:12]}", layout, rank, directory=directory
    )


def region_bytes(region: SharedOffloadRegion) -> np.ndarray:
    """The whole region as a writable (num_blocks, row_stride) uint8 array (no copy)."""
    return np.asarray(region.create_kv_memoryview())


@dataclass(frozen=True)
class Placement:
    """One copy of a job: GPU block `gpu_id` of tensor `tensor` <-> slot `slot` of CPU block
    `cpu_id` of the same tensor's CPU view, `size` bytes."""

    tensor: int
    gpu_id: int
    cpu_id: int
    slot: int
    size: int


def placements(
    gpu_ids: Sequence[int],
    cpu_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    factor: int,
) -> Iterator[Placement]:
    """Where each GPU block of a job goes, from logical positions: group g covers request
    positions [start, start + size); position p sits in slot p % factor of the group's
    (p // factor - start // factor)-th CPU block."""
    gpu_at = cpu_at = 0
    for size, start, refs in zip(group_sizes, block_indices, group_refs, strict=True):
        if size == 0:
            continue
        first_block = start // factor
        for k in range(size):
            position = start + k
            cpu_id = cpu_ids[cpu_at + position // factor - first_block]
            for ref in refs:
                yield Placement(
                    ref.tensor_idx,
                    gpu_ids[gpu_at + k],
                    cpu_id,
                    position % factor,
                    ref.page_size_bytes,
                )
        gpu_at += size
        cpu_at += (start + size - 1) // factor - first_block + 1


T = TypeVar("T")


def on_a_new_thread(work: Callable[[], T]) -> T:
    """work()'s result (or its exception), run on a thread started now, which has no CUDA
    context current. Fails if that thread had one: the test would show nothing."""
    from kvshm.transfer.cuda.driver import cuda_driver

    def run() -> tuple[bool, T]:
        return cuda_driver().has_current_context(), work()

    with ThreadPoolExecutor(max_workers=1) as pool:  # its one thread starts with the job
        had_context, result = pool.submit(run).result()
    assert had_context is False, "the new thread had a CUDA context already"
    return result
