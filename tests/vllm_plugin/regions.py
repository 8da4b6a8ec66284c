"""Regions made as the kvshm agent makes them, and read back through vLLM's own views."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvshm.agent.root.holders import HoldChecker
from kvshm.region import (
    RegionFormat,
    RegionLayout,
    SharedOffloadRegion,
    region_file_name,
    segment_file_name,
)
from kvshm.region.shared_region import OpenMode


def agent_region(
    directory: str,
    instance_id: str,
    num_blocks: int,
    cpu_page_size: int,
    num_workers: int,
    *,
    replicated: bool = False,
    populate: bool = True,
) -> str:
    """Create (populated unless told not to: sparse) and let go of a vllm-0.33 region, leaving
    its files in place (the agent keeps its own mapping but drops its flock, so only serving
    processes count as holders). Returns file 0's path."""
    layout = RegionLayout(
        num_blocks, cpu_page_size, num_workers, RegionFormat.VLLM_0_33, replicated=replicated
    )
    region = SharedOffloadRegion(
        instance_id, layout, directory=directory, mode=OpenMode.CREATE, populate=populate
    )
    region.keep_file()
    path = region.mmap_path
    region.cleanup()
    return path


def is_held(path: str) -> bool:
    """The agent's holder probe."""
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return HoldChecker().is_held(dir_fd, os.path.basename(path), path)
    finally:
        os.close(dir_fd)


@contextmanager
def vllm_views(
    engine_id: str,
    num_chunks: int,
    rank: int,
    kv_bytes_per_chunk: int,
    cpu_page_size: int,
    tensor_pages: list[int],
    *,
    sparse: bool = False,
) -> Iterator[list[torch.Tensor]]:
    """vLLM 0.33's own SharedOffloadRegion, joining the existing files in /dev/shm as its
    CPUOffloadingSpec would (num_segments=32), and its worker views, one per tensor.

    sparse: vLLM prefaults only one row's share (its populate_shard with a share per row), so
    a large sparse region stays sparse."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import (
        SharedOffloadRegion as VllmRegion,
    )

    region: Any = VllmRegion(
        engine_id=engine_id,
        num_chunks=num_chunks,
        rank=rank,
        kv_bytes_per_chunk=kv_bytes_per_chunk,
        cpu_page_size=cpu_page_size,
        num_segments=32,
        populate_shard=(0, num_chunks) if sparse else None,
    )
    assert not region._creator, "vLLM created the file: the agent's region was not there"
    views = [region.create_next_worker_view(page) for page in tensor_pages]
    try:
        yield views
    finally:
        views.clear()  # the mapping can only close once no view is left
        region.cleanup()


def region_file(directory: str, instance_id: str) -> str:
    return os.path.join(directory, region_file_name(instance_id))


def remove_region(directory: str, instance_id: str) -> None:
    """Remove every file of the region, as the agent does once nothing holds it."""
    for index in range(32):
        path = os.path.join(directory, segment_file_name(instance_id, index))
        if not os.path.lexists(path):
            return
        os.unlink(path)
