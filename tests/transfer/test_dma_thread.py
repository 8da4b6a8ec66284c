"""The DMA backend called from a thread with no CUDA context current (one the process
started): the driver's batch call refuses every stream there, and falling back to a call per
copy moved 3-10 GB/s where the batch call moves 51 (H100, docs/transfer.md F43)."""

from __future__ import annotations

import pytest
import torch

from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.cuda.driver import CopyDirection, cuda_driver
from kvshm.transfer.cuda.streams import give_back, own_stream
from kvshm.transfer.jobs.batch import CopyBatch

from .helpers import on_a_new_thread

pytestmark = pytest.mark.gpu

PAGE = 32 * 1024
BLOCKS = 64


def test_a_thread_without_a_context_keeps_the_batch_call_byte_exact() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8, device=device)
    host = torch.zeros((BLOCKS, PAGE), dtype=torch.int8).pin_memory()
    order = torch.randperm(BLOCKS)
    batch = CopyBatch.allocate(BLOCKS)
    batch.rows[0] = [gpu[int(b)].data_ptr() for b in order]
    batch.rows[1] = [host[k].data_ptr() for k in range(BLOCKS)]
    batch.rows[2] = PAGE
    dma = DmaBackend(cuda_driver(), CopyDirection(True, device.index))
    stream = own_stream(device)

    def issue() -> bool:
        dma.issue(batch.with_total(BLOCKS * PAGE), stream)
        return cuda_driver().has_current_context()

    context_after = on_a_new_thread(issue)
    stream.synchronize()
    give_back(stream)
    assert context_after is True
    assert dma.uses_batch, "the backend fell back to a call per copy"
    assert torch.equal(host, gpu[order.to(device)].cpu())
