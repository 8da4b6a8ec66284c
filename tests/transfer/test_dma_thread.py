"""The DMA backend called from a thread with no CUDA context current (one the process
started): the driver's batch call refuses every stream there, and falling back to a call per
copy moved 3-10 GB/s where the batch call moves 51 (H100, docs/transfer.md F43)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvshm.transfer.backends.cuda_driver import CopyDirection, cuda_driver
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.batch import CopyBatch
from kvshm.transfer.streams import give_back, own_stream

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
    seen: dict[str, object] = {}

    def issue() -> None:
        try:
            seen["context before"] = cuda_driver().has_current_context()
            dma.issue(batch.with_total(BLOCKS * PAGE), stream)
            seen["context after"] = cuda_driver().has_current_context()
        except Exception as exc:  # reported below, not lost in the thread
            seen["error"] = exc

    thread = threading.Thread(target=issue)
    thread.start()
    thread.join()
    stream.synchronize()
    give_back(stream)
    assert "error" not in seen, seen
    assert seen["context before"] is False  # else this test shows nothing
    assert seen["context after"] is True
    assert dma.uses_batch, "the backend fell back to a call per copy"
    assert torch.equal(host, gpu[order.to(device)].cpu())
