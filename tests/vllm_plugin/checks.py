"""Running jobs through an OffloadingWorker and checking bytes against vLLM's region views."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tests.vllm_plugin.jobs import Job


def finish(worker: Any, job_ids: set[int], timeout: float = 30.0) -> dict[int, Any]:
    """Wait for the jobs and collect their results from get_finished(), by job id."""
    worker.wait(job_ids)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while set(results) != job_ids:
        for result in worker.get_finished():
            results[result.job_id] = result
        assert time.monotonic() < deadline, f"jobs {job_ids - set(results)} never finished"
    return results


def gpu_pages(kv_caches: Any) -> list[torch.Tensor]:
    return [t.tensor for t in kv_caches.tensors]


def group_tensors(kv_caches: Any) -> list[list[int]]:
    return [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]


def assert_region_matches_gpu(
    job: Job,
    kv_caches: Any,
    views: Sequence[torch.Tensor],
    blocks_per_chunk: int,
) -> int:
    """Every page the job covers is equal on the GPU and in vLLM's view; returns the pages."""
    gpu = gpu_pages(kv_caches)
    groups = group_tensors(kv_caches)
    checked = 0
    for g, block, chunk, sub in job.placements(blocks_per_chunk):
        for t in groups[g]:
            page = gpu[t].shape[1]
            in_region = views[t][chunk, sub * page : (sub + 1) * page]
            on_gpu = gpu[t][block].cpu()
            assert torch.equal(in_region, on_gpu), (
                f"group {g} tensor {t}: GPU block {block} differs from CPU chunk {chunk} "
                f"sub-block {sub}"
            )
            checked += 1
    return checked


def job_bytes(job: Job, kv_caches: Any) -> int:
    groups = group_tensors(kv_caches)
    pages = [t.page_size_bytes for t in kv_caches.tensors]
    return sum(size * sum(pages[t] for t in groups[g]) for g, size in enumerate(job.group_sizes))
