"""What a calibration's trials move: scratch GPU blocks shaped as the KV tensors, and jobs of a
request's size between them and this worker's cells of the region."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvshm.transfer.jobs.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvshm.transfer.jobs.uniform import row_pitch

SCRATCH_BYTES = 256 * 1024 * 1024  # GPU memory the measurement borrows, at most...
MIN_SCRATCH_BYTES = 16 * 1024 * 1024  # ...and at least (but a quarter of what is free)
MAX_SCRATCH_BLOCKS = 1024
JOB_BLOCKS = 16  # blocks per job: a request's few hundred tokens, as the benchmark moves them

Spec = tuple[GPULoadStoreSpec, CPULoadStoreSpec]


def scratch_tensors(gpu_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Scratch GPU blocks shaped as the KV tensors: where those are views of one allocation a
    fixed pitch apart (vLLM 0.33's layer-outer cache), so are the scratch tensors, so that the
    strided backend can be measured on them."""
    per_block = sum(t.shape[1] for t in gpu_tensors)
    budget = SCRATCH_BYTES
    device = gpu_tensors[0].device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = max(MIN_SCRATCH_BYTES, min(budget, free // 4))
    blocks = max(2, min(MAX_SCRATCH_BLOCKS, budget // per_block))
    if one_allocation_pitch(gpu_tensors) is not None:
        backing = torch.empty(
            (len(gpu_tensors), blocks, gpu_tensors[0].shape[1]), dtype=torch.int8, device=device
        )
        return list(backing)
    return [torch.empty((blocks, t.shape[1]), dtype=torch.int8, device=device) for t in gpu_tensors]


def one_allocation_pitch(tensors: Sequence[torch.Tensor]) -> int | None:
    """The bytes from each tensor's first row to the next tensor's, where the tensors are rows
    of one shape in one allocation at that pitch (above their own size, no more than a 2-D
    copy takes); else None."""
    if len(tensors) < 2 or any(t.shape != tensors[0].shape for t in tensors):
        return None
    storage = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    size = tensors[0].shape[0] * tensors[0].stride(0) * tensors[0].element_size()
    return row_pitch([t.data_ptr() for t in tensors], size)


@dataclass(frozen=True)
class Workload:
    """Jobs of JOB_BLOCKS random blocks between the scratch tensors and this worker's cells:
    each one-way run moves every scratch block once; the both-ways run stores one half of them
    while it loads the other, the same bytes in all."""

    every: list[Spec]
    stores: list[Spec]
    loads: list[Spec]

    @classmethod
    def of(
        cls, scratch_blocks: int, num_chunks: int, groups: int, blocks_per_chunk: int
    ) -> Workload:
        rng = np.random.default_rng(0)
        per_job = max(blocks_per_chunk, JOB_BLOCKS - JOB_BLOCKS % blocks_per_chunk)
        blocks = min(scratch_blocks, num_chunks * blocks_per_chunk)
        if blocks >= 2 * per_job:
            blocks -= blocks % (2 * per_job)  # whole jobs, in both halves
        gpu = rng.permutation(blocks)
        cpu = rng.choice(num_chunks, -(-blocks // blocks_per_chunk), replace=False)

        def jobs(first: int, last: int) -> list[Spec]:
            out = []
            for at in range(first, last, per_job):
                n = min(per_job, last - at)
                sizes = [n] + [0] * (groups - 1)  # the tensors of group 0 carry the pages
                chunk = at // blocks_per_chunk
                out.append(
                    (
                        GPULoadStoreSpec(gpu[at : at + n], sizes, [0] * groups),
                        CPULoadStoreSpec(cpu[chunk : chunk + -(-n // blocks_per_chunk)]),
                    )
                )
            return out

        half = blocks // 2
        return cls(jobs(0, blocks), jobs(0, half), jobs(half, blocks))
