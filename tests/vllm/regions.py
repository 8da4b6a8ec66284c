"""Regions made as the kvshm agent makes them, and read back through vLLM's own views."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvshm.agent.holders import HoldChecker
from kvshm.region import SharedOffloadRegion, region_file_name
from kvshm.region.shared_region import OpenMode


def agent_region(
    directory: str, instance_id: str, num_blocks: int, cpu_page_size: int, num_workers: int
) -> str:
    """Create, populate and let go of a region file, leaving it in place (the agent keeps its
    own mapping but drops its flock, so only serving processes count as holders)."""
    region = SharedOffloadRegion(
        instance_id,
        num_blocks * cpu_page_size * num_workers,
        num_blocks,
        None,
        num_workers,
        cpu_page_size,
        directory=directory,
        mode=OpenMode.CREATE,
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
) -> Iterator[list[torch.Tensor]]:
    """vLLM 0.33's own SharedOffloadRegion, joining the existing file in /dev/shm as its
    CPUOffloadingSpec would (num_segments=32), and its worker views, one per tensor."""
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
