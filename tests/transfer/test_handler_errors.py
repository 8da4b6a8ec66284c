"""Every invalid handler or job is refused with an error that says what is wrong."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.transfer import (
    BACKEND_ENV,
    BackendUnavailableError,
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidTensorsError,
    InvalidTransferSpecError,
    SingleDirectionOffloadingHandler,
)

REFS = [[CanonicalKVCacheRef(0, 32)], [CanonicalKVCacheRef(1, 32)]]


def tensors(gpu_rows: int = 16, cpu_rows: int = 8, factor: int = 2) -> tuple[list, list]:
    gpu = [torch.zeros((gpu_rows, 32), dtype=torch.int8) for _ in range(2)]
    cpu = [torch.zeros((cpu_rows, 32 * factor), dtype=torch.int8) for _ in range(2)]
    return gpu, cpu


def build(**overrides: Any) -> SingleDirectionOffloadingHandler:
    gpu, cpu = tensors()
    arguments: dict[str, Any] = dict(
        gpu_tensors=gpu,
        cpu_tensors=cpu,
        blocks_per_chunk=2,
        layer_refs_per_group=REFS,
        gpu_to_cpu=True,
    )
    arguments.update(overrides)
    return SingleDirectionOffloadingHandler(**arguments)


def int8(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int8, device=device)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gpu_tensors": []}, "gpu_tensors must be a non-empty list"),
        ({"cpu_tensors": [int8(8, 64)]}, "2 GPU tensors, got 1 CPU tensors"),
        ({"gpu_tensors": [int8(16, 32).float(), int8(16, 32)]}, "must have dtype int8"),
        ({"gpu_tensors": [int8(16, 32, 1), int8(16, 32)]}, "must be 2-D"),
        ({"cpu_tensors": [int8(8, 64), torch.zeros(8, 64)]}, "cpu_tensors[1] must have dtype"),
        ({"cpu_tensors": [int8(8, 64), int8(8, 64, device="meta")]}, "must be in CPU memory"),
        (
            {"gpu_tensors": [int8(16, 32), int8(16, 32, device="meta")]},
            "all GPU tensors must be on one device",
        ),
        ({"blocks_per_chunk": 4}, "need 128"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk must be >= 1"),
        ({"blocks_per_chunk": 2.0}, "blocks_per_chunk must be an integer"),
        ({"layer_refs_per_group": []}, "must list, per KV-cache group"),
        ({"layer_refs_per_group": [[CanonicalKVCacheRef(2, 32)]]}, "refers to tensor 2"),
        ({"layer_refs_per_group": [[CanonicalKVCacheRef(0, 33)]]}, "must be in (0, 32]"),
        ({"layer_refs_per_group": [[CanonicalKVCacheRef(0, 0)]]}, "must be in (0, 32]"),
    ],
)
def test_bad_tensors_and_refs(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTensorsError, match=re.escape(message)):
        build(**overrides)


def test_refs_may_be_plain_tuples() -> None:
    handler = build(layer_refs_per_group=[[(0, 32)], [(1, 16)]])
    assert handler.kv_cache_groups_data_refs[1] == [CanonicalKVCacheRef(1, 16)]
    handler.shutdown()


@pytest.fixture
def handler() -> Iterator[SingleDirectionOffloadingHandler]:
    handler = build()
    yield handler
    handler.shutdown()


def gpu(ids: list[int], sizes: list[int], starts: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(np.array(ids, dtype=np.int64), sizes, starts)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("not a pair", "a transfer spec is a (source spec, destination spec) pair"),
        (
            (CPULoadStoreSpec([0]), gpu([0], [1, 0], [0, 0])),
            "got (CPULoadStoreSpec, GPULoadStoreSpec)",
        ),
        ((gpu([0], [1], [0]), CPULoadStoreSpec([0])), "2 KV-cache groups but the GPU spec gives 1"),
        ((gpu([0], [1, -1], [0, 0]), CPULoadStoreSpec([0])), "must be >= 0"),
        ((gpu([0, 1], [1, 0], [0, 0]), CPULoadStoreSpec([0])), "use 1 GPU block ids but the GPU"),
        (
            (gpu([0, 1], [2, 0], [0, 0]), CPULoadStoreSpec([0, 1])),
            "use 1 CPU block ids but the CPU",
        ),
        ((gpu([0, 1], [2, 0], [1, 0]), CPULoadStoreSpec([0])), "use 2 CPU block ids but the CPU"),
        ((gpu([0, 16], [2, 0], [0, 0]), CPULoadStoreSpec([0])), "GPU block ids must be in [0, 16)"),
        ((gpu([0], [1, 0], [0, 0]), CPULoadStoreSpec([8])), "CPU block ids must be in [0, 8)"),
    ],
)
def test_bad_specs(handler: SingleDirectionOffloadingHandler, spec: Any, message: str) -> None:
    with pytest.raises(InvalidTransferSpecError, match=re.escape(message)):
        handler.transfer_async(1, spec)
    assert handler.get_finished() == []  # nothing was queued


def test_specs_check_their_block_ids() -> None:
    with pytest.raises(InvalidTransferSpecError, match="CPU block ids must be integers, got dtype"):
        CPULoadStoreSpec([0.5])
    with pytest.raises(
        InvalidTransferSpecError, match=re.escape("must be 1-D, got an array of shape (1, 1)")
    ):
        GPULoadStoreSpec([[0]], [1], [0])


def test_a_job_id_in_flight_cannot_be_reused(handler: SingleDirectionOffloadingHandler) -> None:
    spec = (gpu([0], [1, 0], [0, 0]), CPULoadStoreSpec([0]))
    handler.transfer_async(1, spec)
    with pytest.raises(InvalidTransferSpecError, match="job 1 is still in flight"):
        handler.transfer_async(1, spec)
    handler.wait([1])
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert handler.transfer_async(1, spec)  # finished ids may come back


@pytest.mark.parametrize("backend", ["dma", "kernel", "staged"])
def test_asking_for_a_gpu_backend_with_cpu_tensors_says_why(backend: str) -> None:
    with pytest.raises(
        BackendUnavailableError, match=f"'{backend}' cannot be used: the 'GPU' tensors"
    ):
        build(backend=backend)


def test_backend_override_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "kernel")
    with pytest.raises(BackendUnavailableError, match="'kernel' cannot be used"):
        build()
    monkeypatch.setenv(BACKEND_ENV, "fastest")
    with pytest.raises(BackendUnavailableError, match="is not a backend: use one of dma, kernel"):
        build()
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    handler = build()
    assert handler.backends == ["cpu"]
    handler.shutdown()
