"""kvshm's own CUDA streams (kvshm.transfer.cuda.streams): none of torch's pooled streams, they run
work, and one given back is lent again."""

from __future__ import annotations

import pytest
import torch

from kvshm.transfer.cuda import streams
from kvshm.transfer.cuda.streams import give_back, own_stream

from .helpers import on_a_new_thread

pytestmark = pytest.mark.gpu


def pooled_streams() -> set[int]:
    """Every stream torch.cuda.Stream() hands out on this device at priorities 0 and -1 (a
    pool of 32 per priority, given in turn)."""
    return {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(64)}


def test_an_own_stream_is_none_of_torchs_and_runs_work() -> None:
    pool = pooled_streams()
    assert len(pool) >= 32  # the pool was found, else the check below says nothing
    stream = own_stream(torch.device("cuda"))
    assert stream.cuda_stream not in pool
    x = torch.arange(1 << 20, device="cuda")
    with torch.cuda.stream(stream):
        doubled = x * 2
    stream.synchronize()
    assert torch.equal(doubled, torch.arange(0, 1 << 21, 2, device="cuda"))


def test_a_stream_given_back_is_lent_again() -> None:
    device = torch.device("cuda")
    first = own_stream(device)
    handle = first.cuda_stream
    give_back(first)
    again = own_stream(device)
    assert again.cuda_stream == handle
    assert own_stream(device).cuda_stream != handle  # lent once: the next is another


def test_a_thread_without_a_context_gets_a_stream_that_runs_work() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    # take every stream given back earlier, so that the thread's is created there
    taken = [own_stream(device) for _ in streams._free.get(device.index, []).copy()]
    try:
        stream = on_a_new_thread(lambda: own_stream(device))
    finally:
        for each in taken:
            give_back(each)
    assert isinstance(stream, torch.cuda.ExternalStream)
    x = torch.arange(1 << 16, device=device)
    with torch.cuda.stream(stream):
        tripled = x * 3
    stream.synchronize()
    assert torch.equal(tripled, torch.arange(0, 3 << 16, 3, device=device))
    give_back(stream)
