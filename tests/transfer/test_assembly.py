"""A worker's handlers as kvshm.transfer.assembly builds them: views in order over the region,
the named set of handlers, and which backends each gets (measured, forced, per job, or the
first copy-engines backend that builds). On a CPU machine memmove is the only backend; the GPU
backends refuse with their reasons, which is what the fallbacks are for."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from kvshm.region import InvalidLayoutError
from kvshm.transfer import (
    BackendUnavailableError,
    CanonicalKVCacheRef,
    ChoiceCache,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    HandlerAssembly,
    HandlerLayout,
)
from kvshm.transfer.calibration.cache import CACHE_FILE, host_key, layout_key

from .helpers import open_region, region_bytes, unpadded

CPU = torch.device("cpu")


def test_views_are_this_workers_consecutive_slices_of_its_cell(tmp_path: Path) -> None:
    with open_region(str(tmp_path), unpadded(6, 3 * 64, 2), 1) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8), torch.zeros((4, 16), dtype=torch.int8)]
        refs = [[CanonicalKVCacheRef(0, 32), CanonicalKVCacheRef(1, 16)]]
        layout = HandlerLayout.over_region(gpu, region, 2, refs)
        first, second = layout.cpu_tensors
        assert first.shape == (6, 64) and second.shape == (6, 32)
        assert first.stride() == second.stride() == (2 * 3 * 64, 1)
        base = region.address
        assert first.data_ptr() == base + 3 * 64  # rank 1's cell
        assert second.data_ptr() == base + 3 * 64 + 64
        assert layout.num_chunks == 6


def test_tensors_that_do_not_fit_the_cell_are_refused(tmp_path: Path) -> None:
    with open_region(str(tmp_path), unpadded(4, 64, 2), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8) for _ in range(3)]
        with pytest.raises(InvalidLayoutError, match="overflows worker 0's 64-byte cell by 32"):
            HandlerLayout.over_region(gpu, region, 1, [[CanonicalKVCacheRef(0, 32)]])


def test_a_store_a_load_and_an_expedited_load_each_with_a_handler_of_its_own(
    tmp_path: Path,
) -> None:
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.randint(-128, 128, (4, 32), dtype=torch.int8)]
        layout = HandlerLayout.over_region(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        assembly = HandlerAssembly(layout)
        handlers = assembly.build()
        assert [h.gpu_to_cpu for h in handlers] == [True, False, False]
        assert len({id(h) for h in handlers}) == 3
        assert handlers.backends() == {"store": ["cpu"], "load": ["cpu"], "expedited_load": ["cpu"]}
        assert (assembly.chosen_backends, assembly.calibration_seconds) == ({}, None)

        store = (GPULoadStoreSpec([3, 1, 2], [3], [1]), CPULoadStoreSpec([5, 0]))
        assert handlers.store.transfer_async(1, store)
        handlers.store.wait([1])
        rows = region_bytes(region)
        np.testing.assert_array_equal(rows[5, 32:64], gpu[0][3].numpy().view(np.uint8))
        np.testing.assert_array_equal(rows[0, :32], gpu[0][1].numpy().view(np.uint8))
        expected = gpu[0][[3, 1, 2]].clone()
        gpu[0].zero_()
        back = (CPULoadStoreSpec([5, 0]), GPULoadStoreSpec([0, 1, 2], [3], [1]))
        assert handlers.expedited_load.transfer_async(2, back)
        handlers.expedited_load.wait([2])
        assert torch.equal(gpu[0][:3], expected)
        assert [r.job_id for r in handlers.store.get_finished()] == [1]
        assert handlers.load.get_finished() == []
        assert [r.job_id for r in handlers.expedited_load.get_finished()] == [2]
        for handler in handlers:
            handler.shutdown()


def cached(directory: Path, layout: HandlerLayout, choice: dict[str, str]) -> ChoiceCache:
    """A cache holding `choice` for this host and layout, as an earlier start measured it."""
    cache = ChoiceCache(directory)
    pages = [t.shape[1] for t in layout.gpu_tensors]
    key = layout_key(pages, layout.blocks_per_chunk)
    cache.put(host_key(CPU), key, choice)
    return cache


def test_a_measured_backend_that_cannot_be_built_gives_way_to_the_choice_per_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A choice measured on this host whose backend no longer builds (DMA here, with no CUDA)
    must not stop the engine: the handler chooses per job instead."""
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8)]
        layout = HandlerLayout.over_region(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        cache = cached(tmp_path / "cache", layout, {"store": "dma", "load": "dma"})
        assembly = HandlerAssembly(layout, calibration=cache)
        with caplog.at_level(logging.WARNING):
            handlers = assembly.build()
        assert assembly.chosen_backends == {"store": "dma", "load": "dma"}
        assert handlers.backends() == {"store": ["cpu"], "load": ["cpu"], "expedited_load": ["cpu"]}
        warned = [r.getMessage() for r in caplog.records]
        assert warned.count("kvshm: the measured store backends cannot be built") == 1
        assert warned.count("kvshm: the measured load backends cannot be built") == 2


def test_copy_engines_without_a_measurement_takes_the_first_backend_that_builds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Strided, then DMA, then memmove: on a CPU machine the first two refuse, and the log
    says why each was passed over."""
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8)]
        layout = HandlerLayout.over_region(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        assembly = HandlerAssembly(layout, "copy-engines")
        assert assembly.forced is None
        with caplog.at_level(logging.INFO):
            handlers = assembly.build()
        assert handlers.backends() == {"store": ["cpu"], "load": ["cpu"], "expedited_load": ["cpu"]}
        taken = [r.getMessage() for r in caplog.records if "copy-engines takes" in r.getMessage()]
        assert len(taken) == 3
        assert all(m.startswith("kvshm: copy-engines takes cpu: ") for m in taken)
        assert all("'strided'" in m and "'dma'" in m for m in taken)


def test_a_forced_backend_is_never_measured(tmp_path: Path) -> None:
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8)]
        layout = HandlerLayout.over_region(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        cache = ChoiceCache(tmp_path / "cache")
        assembly = HandlerAssembly(layout, "cpu", cache)
        assert assembly.forced == "cpu"
        handlers = assembly.build()
        assert handlers.backends()["store"] == ["cpu"]
        assert (assembly.chosen_backends, assembly.calibration_seconds) == ({}, None)
        assert not (tmp_path / "cache" / CACHE_FILE).exists()
        with pytest.raises(BackendUnavailableError, match="'dma' cannot be used"):
            HandlerAssembly(layout, "dma", cache).build()


def test_an_unforced_assembly_measures_once_and_keeps_the_choice(tmp_path: Path) -> None:
    with open_region(str(tmp_path), unpadded(6, 64, 1), 0) as region:
        gpu = [torch.zeros((4, 32), dtype=torch.int8)]
        layout = HandlerLayout.over_region(gpu, region, 2, [[CanonicalKVCacheRef(0, 32)]])
        assembly = HandlerAssembly(layout, calibration=ChoiceCache(tmp_path / "cache"))
        handlers = assembly.build()
        choice = {"store": "cpu", "load": "cpu", "store_beside": "cpu", "load_beside": "cpu"}
        assert assembly.chosen_backends == choice
        assert assembly.calibration_seconds is not None and assembly.calibration_seconds > 0
        saved = json.loads((tmp_path / "cache" / CACHE_FILE).read_text())
        assert list(saved[host_key(CPU)].values()) == [choice]
        assert handlers.backends()["load"] == ["cpu"]
