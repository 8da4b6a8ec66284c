"""Jobs in vLLM 0.33's terms, and where each GPU block's pages land in the CPU region.

The placement rule (vLLM's SingleDirectionOffloadingHandler.transfer_async): group g's GPU
blocks are the next group_sizes[g] ids of the GPU spec; they start skip = block_indices[g] %
blocks_per_chunk sub-blocks into the group's first CPU chunk and use the next
ceil((size + skip) / blocks_per_chunk) ids of the CPU spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Job:
    gpu_ids: list[int]
    cpu_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]

    def specs(self) -> tuple[object, object]:
        """(vLLM's GPULoadStoreSpec, vLLM's CPULoadStoreSpec)."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        gpu = GPULoadStoreSpec(self.gpu_ids, self.group_sizes, self.block_indices)
        return gpu, CPULoadStoreSpec(self.cpu_ids)

    def placements(self, blocks_per_chunk: int) -> list[tuple[int, int, int, int]]:
        """(group, GPU block, CPU chunk, sub-block in the chunk) for every GPU block."""
        out = []
        gpu_at = cpu_at = 0
        for g, (size, start) in enumerate(zip(self.group_sizes, self.block_indices, strict=True)):
            if size == 0:
                continue
            skip = start % blocks_per_chunk
            for k in range(size):
                chunk, sub = divmod(skip + k, blocks_per_chunk)
                out.append((g, self.gpu_ids[gpu_at + k], self.cpu_ids[cpu_at + chunk], sub))
            gpu_at += size
            cpu_at += -(-(size + skip) // blocks_per_chunk)
        assert gpu_at == len(self.gpu_ids) and cpu_at == len(self.cpu_ids)
        return out


def random_job(
    rng: np.random.Generator,
    num_gpu_blocks: int,
    num_chunks: int,
    blocks_per_chunk: int,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    avoid_cpu: Sequence[int] = (),
) -> Job:
    """Distinct random ids on both sides for the given groups (CPU ids not in avoid_cpu)."""
    cpu_needed = sum(
        -(-(size + start % blocks_per_chunk) // blocks_per_chunk) if size else 0
        for size, start in zip(group_sizes, block_indices, strict=True)
    )
    gpu = rng.choice(num_gpu_blocks, sum(group_sizes), replace=False)
    free = np.setdiff1d(np.arange(num_chunks), np.asarray(avoid_cpu, dtype=np.int64))
    cpu = rng.choice(free, cpu_needed, replace=False)
    return Job(gpu.tolist(), cpu.tolist(), list(group_sizes), list(block_indices))
