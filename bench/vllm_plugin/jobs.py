"""The jobs bench/vllm_plugin's benchmarks move: vLLM's own spec objects over random block ids
on both sides, issued through a worker's vLLM 0.33 contract."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tests.vllm_plugin.layouts import KvLayout


def job_specs(gpu_ids: np.ndarray, cpu_ids: np.ndarray, per_job: int) -> list[tuple[Any, Any]]:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return [
        (
            GPULoadStoreSpec(
                gpu_ids[i : i + per_job].tolist(), [len(gpu_ids[i : i + per_job])], [0]
            ),
            CPULoadStoreSpec(cpu_ids[i : i + per_job].tolist()),
        )
        for i in range(0, len(gpu_ids), per_job)
    ]


_job_ids: Iterator[int] = iter(range(1, 1 << 62))


def issue_and_wait(worker: Any, stores: list[Any], loads: list[Any]) -> float:
    """Submit the stores and loads (interleaved) and wait until get_finished reported all;
    return the seconds spent submitting."""
    ids: set[int] = set()
    started = time.perf_counter()
    for i in range(max(len(stores), len(loads))):
        if i < len(stores):
            ids.add(job_id := next(_job_ids))
            assert worker.submit_store(job_id, *stores[i])
        if i < len(loads):
            ids.add(job_id := next(_job_ids))
            gpu, cpu = loads[i]
            assert worker.submit_load(job_id, cpu, gpu)
    submitting = time.perf_counter() - started
    worker.wait(ids)
    while ids:
        for result in worker.get_finished():
            assert result.success, f"job {result.job_id} failed"
            ids.discard(result.job_id)
    return submitting


@dataclass
class Plan:
    nbytes: dict[str, int]
    jobs: dict[str, tuple[list[Any], list[Any]]]


def plan(layout: KvLayout, blocks: int, per_job: int, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    gpu, cpu = rng.permutation(blocks), rng.permutation(blocks)
    half = blocks // 2
    every = job_specs(gpu, cpu, per_job)
    stores = job_specs(gpu[:half], cpu[:half], per_job)
    loads = job_specs(gpu[half:], cpu[half:], per_job)
    per_block = layout.worker_bytes_per_block
    return Plan(
        {"H2D": blocks * per_block, "D2H": blocks * per_block, "both": blocks * per_block},
        {"H2D": ([], every), "D2H": (every, []), "both": (stores, loads)},
    )
