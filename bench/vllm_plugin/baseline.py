"""(b) of bench/vllm_plugin/run.py: vLLM 0.33's own CPUOffloadingWorker from the installed
wheel, on a machine where vLLM travels as Python sources only (its CUDA platform and its
compiled DMA op re-stated where they cannot load), and what building a worker blocks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def vllm_platform_note() -> str:
    """vLLM's worker code asks vllm.platforms.current_platform for streams and pinning. Its
    CUDA platform module loads a compiled extension; where that cannot load here, give vLLM's
    code the minimal CUDA platform it needs (streams from torch.cuda, pinned memory on)."""
    import vllm.platforms as platforms

    try:
        platform = platforms.current_platform
        if platform.is_cuda():
            return "vLLM's own CUDA platform"
        reason = f"vLLM resolved its platform to {type(platform).__name__}"
    except Exception as exc:
        reason = f"vllm.platforms.cuda did not load ({exc!r})"
    from vllm.platforms.interface import Platform, PlatformEnum

    class MinimalCuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"  # Stream, stream, current_stream: torch.cuda's
        dist_backend = "nccl"

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return True

    platforms._current_platform = MinimalCuda()
    return f"{reason}: vLLM's worker code runs on a minimal CUDA platform object"


def vllm_dma_note() -> str:
    """Use vLLM's compiled DMA op if it loads, else re-state it: one cuMemcpyBatchAsync per
    job over all its copies, source order STREAM (ANY for loads), no hints, no flags."""
    from vllm import _custom_ops as ops

    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018
        return "vLLM's compiled swap_blocks_batch (vllm._C)"
    except (AttributeError, RuntimeError):
        pass
    from bench.engine.standins import restated_swap_blocks_batch

    ops.swap_blocks_batch = restated_swap_blocks_batch(location_hints=False)
    return "vllm._C not loadable: its swap_blocks_batch re-stated (one cuMemcpyBatchAsync/job)"


@dataclass
class Built:
    worker: Any
    blocking_seconds: float
    close: Callable[[], None]
    notes: dict[str, Any]


def build_vllm(kv: Any, chunks: int, cell: int, workers: int) -> Built:
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    started = time.perf_counter()
    region = SharedOffloadRegion(
        engine_id=f"kvshm-bench-vllm-{uuid.uuid4().hex[:8]}",
        num_chunks=chunks,
        rank=0,
        kv_bytes_per_chunk=cell * workers,
        cpu_page_size=cell,
        num_segments=32,
    )
    worker = CPUOffloadingWorker(
        kv_caches=kv, blocks_per_chunk=1, num_cpu_chunks=chunks, mmap_region=region
    )
    seconds = time.perf_counter() - started
    return Built(worker, seconds, worker.shutdown, {"pinned": region.is_pinned})
