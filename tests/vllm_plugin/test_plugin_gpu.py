"""The plugin's worker with CUDA KV tensors on the real model layouts, layer-outer and
block-outer (and a two-group model):
stores, loads and expedited loads with random block ids and partial chunks, checked through
vLLM 0.33's own region views; the region registered with CUDA in the background.

    source .gpu/env.sh && python3 -m pytest tests/vllm_plugin -m gpu
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.vllm.attach import attach_region
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.worker import KvshmOffloadingWorker
from tests.vllm_plugin.checks import assert_region_matches_gpu, finish, job_bytes
from tests.vllm_plugin.jobs import Job, random_job
from tests.vllm_plugin.layouts import (
    BLOCK_OUTER_LAYOUTS,
    MULTI_GROUP,
    REAL_LAYOUTS,
    KvLayout,
    canonical_kv_caches,
)
from tests.vllm_plugin.regions import agent_region, is_held, vllm_views

pytestmark = pytest.mark.gpu

SHM = "/dev/shm"
CHUNKS = 24
GPU_BLOCKS = 40
CASES = [
    (layout, blocks_per_chunk, 4 if "tp4" in layout.name else 1, None)
    for layout in (*REAL_LAYOUTS, *BLOCK_OUTER_LAYOUTS, MULTI_GROUP)
    for blocks_per_chunk in (1, 2)
] + [(layout, 1, 4 if "tp4" in layout.name else 1, "strided") for layout in REAL_LAYOUTS[:3]]


@dataclass
class Attached:
    instance_id: str
    path: str
    cell: int
    region: Any


@contextmanager
def attached(layout: KvLayout, blocks_per_chunk: int = 1, workers: int = 1) -> Iterator[Attached]:
    """An agent-made region for the layout in /dev/shm, attached as rank 0; removed after."""
    instance_id = f"kvshm-gpu-test-{uuid.uuid4().hex[:8]}"
    cell = layout.worker_bytes_per_block * blocks_per_chunk
    path = agent_region(SHM, instance_id, CHUNKS, cell, workers)
    try:
        geometry = RegionGeometry(CHUNKS, cell * workers, cell, workers, False)
        yield Attached(instance_id, path, cell, attach_region(SHM, instance_id, geometry, 0, 5.0))
    finally:
        Path(path).unlink(missing_ok=True)


def groups_of(layout: KvLayout, total: int) -> list[int]:
    sizes = [total // layout.groups] * layout.groups
    sizes[0] += total - sum(sizes)
    return sizes


@pytest.mark.parametrize(
    ("layout", "blocks_per_chunk", "workers", "backend"),
    CASES,
    ids=[f"{c[0].name}-bpc{c[1]}" + (f"-{c[3]}" if c[3] else "") for c in CASES],
)
def test_cuda_stores_and_loads_match_vllms_views(
    layout: KvLayout, blocks_per_chunk: int, workers: int, backend: str | None
) -> None:
    with attached(layout, blocks_per_chunk, workers) as a:
        instance_id, path, cell, region = a.instance_id, a.path, a.cell, a.region
        kv = canonical_kv_caches(layout, GPU_BLOCKS, "cuda")
        worker = KvshmOffloadingWorker(
            kv, region, blocks_per_chunk, region_dir=SHM, instance_id=instance_id, backend=backend
        )
        assert is_held(path)
        rng = np.random.default_rng(len(layout.name) * blocks_per_chunk)
        starts = [1 % blocks_per_chunk] * layout.groups  # partial first chunks where bpc > 1
        store = random_job(rng, GPU_BLOCKS, CHUNKS, blocks_per_chunk, groups_of(layout, 9), starts)
        assert worker.submit_store(1, *store.specs())
        result = finish(worker, {1})[1]
        assert result.success and result.transfer_size == job_bytes(store, kv)
        assert worker.pin is not None and worker.pin.pinned and region.is_pinned
        assert worker.first_transfer_wait_seconds is not None
        if backend is not None:
            assert set(worker.handler_backends()["store"]) >= {backend}
        print(
            f"\n{layout.name} bpc={blocks_per_chunk}: created in {worker.create_seconds:.3f}s, "
            f"registration {worker.pin.pin_seconds:.3f}s, first transfer waited "
            f"{worker.first_transfer_wait_seconds:.3f}s; backends {worker.handler_backends()}"
        )
        stored = [t.tensor[store.gpu_ids].clone() for t in kv.tensors]
        pages = [t.page_size_bytes * blocks_per_chunk for t in kv.tensors]
        with vllm_views(instance_id, CHUNKS, 0, cell * workers, cell, pages) as views:
            assert_region_matches_gpu(store, kv, views, blocks_per_chunk)
            # vLLM writes other chunks; an expedited and a regular load bring both back
            load = random_job(
                rng,
                GPU_BLOCKS,
                CHUNKS,
                blocks_per_chunk,
                groups_of(layout, 7),
                starts,
                store.cpu_ids,
            )
            for view in views:
                view[load.cpu_ids] = torch.randint(
                    -128, 128, (len(load.cpu_ids), view.shape[1]), dtype=torch.int8
                )
            free = sorted(set(range(GPU_BLOCKS)) - set(load.gpu_ids))
            back = Job(
                free[: len(store.gpu_ids)], store.cpu_ids, store.group_sizes, store.block_indices
            )
            src, dst = load.specs()
            assert worker.submit_load(2, dst, src, expedited=True)
            src, dst = back.specs()
            assert worker.submit_load(3, dst, src)
            results = finish(worker, {2, 3})
            assert results[2].success and results[3].success
            assert_region_matches_gpu(load, kv, views, blocks_per_chunk)
        at = 0  # each group's tensors came back for that group's blocks only
        for g, size in enumerate(back.group_sizes):
            for ref in kv.group_data_refs[g]:
                got = kv.tensors[ref.tensor_idx].tensor[back.gpu_ids[at : at + size]]
                assert torch.equal(got.cpu(), stored[ref.tensor_idx][at : at + size].cpu())
            at += size
        worker.shutdown()
        assert not is_held(path)


def test_a_load_follows_the_writes_queued_to_its_blocks() -> None:
    """vLLM zeroes freshly allocated blocks on the compute stream; a load into them must land
    after that zeroing, never under it."""
    layout = REAL_LAYOUTS[1]
    with attached(layout) as a:
        instance_id, region = a.instance_id, a.region
        kv = canonical_kv_caches(layout, GPU_BLOCKS, "cuda")
        worker = KvshmOffloadingWorker(kv, region, 1, region_dir=SHM, instance_id=instance_id)
        for view in worker.cpu_tensors:
            view[3] = 77
        job = Job([5], [3], [1], [0])
        for expedited in (False, True):
            torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while ...
            for t in kv.tensors:
                t.tensor[5].zero_()  # ... then zeroes the block the load fills
            src, dst = job.specs()
            assert worker.submit_load(10 + expedited, dst, src, expedited=expedited)
            assert finish(worker, {10 + expedited})[10 + expedited].success
            for t in kv.tensors:
                assert bool((t.tensor[5] == 77).all()), "the load ran before the zeroing"
        worker.shutdown()


@pytest.mark.parametrize("backend", [None, "copy-engines"])
@pytest.mark.parametrize("layout", REAL_LAYOUTS[:3], ids=[x.name for x in REAL_LAYOUTS[:3]])
def test_calibrated_backends_move_the_right_bytes(
    layout: KvLayout,
    backend: str | None,
    tmp_path: Path,
    measurements: list[Any],
) -> None:
    """copy-engines measures the backends that use no SMs, the strided one on scratch blocks
    in one allocation as the cache is, and chooses among them."""
    from kvshm.transfer.calibration import ChoiceCache
    from kvshm.transfer.choice.chooser import SM_FREE_BACKENDS

    with attached(layout) as a:
        instance_id, cell, region = a.instance_id, a.cell, a.region
        kv = canonical_kv_caches(layout, GPU_BLOCKS, "cuda")
        worker = KvshmOffloadingWorker(
            kv,
            region,
            1,
            region_dir=SHM,
            instance_id=instance_id,
            backend=backend,
            calibration=ChoiceCache(tmp_path),
        )
        store = random_job(np.random.default_rng(5), GPU_BLOCKS, CHUNKS, 1, [12], [0])
        assert worker.submit_store(1, *store.specs())
        assert finish(worker, {1})[1].success
        (measurement,) = measurements
        print(f"\n{layout.name} {backend}: {measurement.summary()} -> {worker.chosen_backends}")
        assert set(worker.chosen_backends) == {"store", "load", "store_beside", "load_beside"}
        strided = {"strided"} <= set(measurement.alone["store"]) & set(measurement.alone["load"])
        if backend is None:
            assert not strided, "the strided backend is measured only under copy-engines"
        else:
            assert strided, "the scratch blocks did not lie in one allocation as the cache does"
            assert set(measurement.alone["store"]) <= set(SM_FREE_BACKENDS)
            assert set(worker.chosen_backends.values()) <= set(SM_FREE_BACKENDS)
        for name in ("store", "store_beside"):
            assert worker.chosen_backends[name] in worker.handler_backends()["store"]
        pages = [t.page_size_bytes for t in kv.tensors]
        with vllm_views(instance_id, CHUNKS, 0, cell, cell, pages) as views:
            assert_region_matches_gpu(store, kv, views, 1)
        free = sorted(set(range(GPU_BLOCKS)) - set(store.gpu_ids))[:12]
        back = Job(free, store.cpu_ids, [12], [0])
        src, dst = back.specs()
        assert worker.submit_load(2, dst, src)
        assert finish(worker, {2})[2].success
        for t in kv.tensors:
            assert torch.equal(t.tensor[back.gpu_ids], t.tensor[store.gpu_ids])
        worker.shutdown()
