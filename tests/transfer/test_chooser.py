"""Per-job backend choice by block size and direction, and the override."""

from __future__ import annotations

import pytest

from kvshm.transfer import BackendPolicy, BackendUnavailableError, Direction
from kvshm.transfer.backends.base import CopyBackend, Stream
from kvshm.transfer.batch import CopyBatch
from kvshm.transfer.chooser import BackendChooser


class Named(CopyBackend):
    def __init__(self, name: str) -> None:
        self.label = name

    def copy(self, batch: CopyBatch, stream: Stream) -> None:
        raise AssertionError("never called here")


def batch_of(count: int, each: int) -> CopyBatch:
    return CopyBatch.allocate(count).with_total(count * each)


POLICY = BackendPolicy({Direction.CPU_TO_GPU: 128 * 1024, Direction.GPU_TO_CPU: 0})


def chooser(direction: Direction, override: str | None = None) -> BackendChooser:
    backends = {"dma": Named("dma"), "kernel": Named("kernel")}
    return BackendChooser(backends, {"cpu": "no"}, direction, POLICY, override)


def label(backend: CopyBackend) -> str:
    assert isinstance(backend, Named)
    return backend.label


def test_small_blocks_go_to_the_kernel_large_ones_to_dma() -> None:
    load = chooser(Direction.CPU_TO_GPU)
    assert label(load.choose(batch_of(100, 16 * 1024))) == "kernel"
    assert label(load.choose(batch_of(100, 64 * 1024))) == "kernel"
    assert label(load.choose(batch_of(10, 128 * 1024))) == "dma"
    assert label(load.choose(batch_of(4, 2 * 1024 * 1024))) == "dma"


def test_thresholds_are_per_direction() -> None:
    store = chooser(Direction.GPU_TO_CPU)
    assert label(store.choose(batch_of(100, 16 * 1024))) == "dma"


def test_override_wins_and_must_exist() -> None:
    assert label(chooser(Direction.GPU_TO_CPU, "kernel").choose(batch_of(1, 2**21))) == "kernel"
    with pytest.raises(BackendUnavailableError, match="'cpu' cannot be used: no"):
        chooser(Direction.GPU_TO_CPU, "cpu")


def test_without_a_kernel_everything_goes_to_dma() -> None:
    only_dma = BackendChooser(
        {"dma": Named("dma")}, {"kernel": "x"}, Direction.CPU_TO_GPU, POLICY, None
    )
    assert label(only_dma.choose(batch_of(100, 16 * 1024))) == "dma"
