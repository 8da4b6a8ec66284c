"""A worker's handlers share a Traffic: a handler given a backend for each case picks per job by
whether the other direction has jobs in flight (the pick itself: test_gpu_transfer.py)."""

from __future__ import annotations

import pytest
import torch

from kvshm.transfer import BackendUnavailableError, CanonicalKVCacheRef
from kvshm.transfer import SingleDirectionOffloadingHandler as Handler
from kvshm.transfer.choice.traffic import Traffic
from kvshm.transfer.metrics import Direction


def test_traffic_counts_each_direction_and_never_goes_below_zero() -> None:
    traffic = Traffic()
    assert not traffic.other_busy(Direction.GPU_TO_CPU)
    traffic.started(Direction.CPU_TO_GPU)
    traffic.started(Direction.CPU_TO_GPU)
    assert traffic.other_busy(Direction.GPU_TO_CPU)
    assert not traffic.other_busy(Direction.CPU_TO_GPU)  # its own jobs do not count
    traffic.finished(Direction.CPU_TO_GPU)
    assert traffic.other_busy(Direction.GPU_TO_CPU)
    traffic.finished(Direction.CPU_TO_GPU)
    traffic.finished(Direction.CPU_TO_GPU)
    assert not traffic.other_busy(Direction.GPU_TO_CPU)
    traffic.started(Direction.CPU_TO_GPU)
    assert traffic.other_busy(Direction.GPU_TO_CPU)


def test_traffic_retires_several_jobs_at_once() -> None:
    traffic = Traffic()
    for _ in range(3):
        traffic.started(Direction.GPU_TO_CPU)
    traffic.finished(Direction.GPU_TO_CPU, 2)
    assert traffic.other_busy(Direction.CPU_TO_GPU)
    traffic.finished(Direction.GPU_TO_CPU, 5)  # more than in flight: none left, not negative
    assert not traffic.other_busy(Direction.CPU_TO_GPU)
    traffic.started(Direction.GPU_TO_CPU)
    assert traffic.other_busy(Direction.CPU_TO_GPU)


def test_a_backend_named_for_busy_traffic_must_exist() -> None:
    gpu = [torch.zeros((4, 64), dtype=torch.int8)]
    cpu = [torch.zeros((4, 64), dtype=torch.int8)]
    refs = [[CanonicalKVCacheRef(0, 64)]]
    with pytest.raises(BackendUnavailableError, match="'dma' cannot be used"):
        Handler(gpu, cpu, 1, refs, True, backend="cpu", backend_beside="dma", traffic=Traffic())
    # the same name for both cases is one forced backend: no traffic needed
    handler = Handler(gpu, cpu, 1, refs, True, backend="cpu", backend_beside="cpu")
    assert handler.backends == ["cpu"]
    handler.shutdown()
