"""The plugin on vLLM 0.33's region formats: padded rows (a rank's cell not page-aligned) and a
segmented region (> 2 GiB over two files, sparse), stored and loaded by the plugin's worker with
the CPU backend and read back through vLLM's own SharedOffloadRegion views."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.vllm.attach import RegionGeometryMismatch
from tests.vllm_plugin.checks import assert_region_matches_gpu, finish
from tests.vllm_plugin.conftest import Engine
from tests.vllm_plugin.engine import BLOCKS_PER_CHUNK, GPU_BLOCKS, offloading_spec
from tests.vllm_plugin.jobs import Job
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches
from tests.vllm_plugin.regions import agent_region, is_held, remove_region, vllm_views

SHM = "/dev/shm"  # vLLM's SharedOffloadRegion only looks here
GIB = 1024**3


@pytest.fixture
def cleanup_region(engine: Engine) -> Iterator[None]:
    yield
    remove_region(SHM, engine.engine_id)


def spec_for(engine: Engine, layout: KvLayout, cpu_bytes: int, world_size: int, rank: int) -> Any:
    """The plugin's spec for this engine with another model layout, region size and rank."""
    from kvshm.vllm.spec import KvshmOffloadingSpec

    base = offloading_spec(engine.config, GPU_BLOCKS).config
    config = dataclasses.replace(
        base,
        worker_kv_bytes_per_block=layout.worker_bytes_per_block,
        extra_config={**base.extra_config, "cpu_bytes_to_use": cpu_bytes},
        parallel=dataclasses.replace(
            base.parallel, world_size=world_size, tp_size=world_size, rank=rank
        ),
    )
    return KvshmOffloadingSpec(config)


def store_check_load(
    spec: Any, layout: KvLayout, rank: int, chunks: list[int], sparse: bool
) -> None:
    """Store GPU blocks into `chunks` (a partial first chunk), check them through vLLM's views,
    write other bytes there through vLLM's views and load them back."""
    kv = canonical_kv_caches(layout, GPU_BLOCKS, "cpu")
    worker = spec.get_worker(kv)
    geometry = spec.region_geometry
    path = os.path.join(SHM, f"vllm_offload_{spec.settings.instance_id}.mmap")
    assert is_held(path)
    rng = np.random.default_rng(7)
    size = len(chunks) * BLOCKS_PER_CHUNK - 1  # starts one block into the first chunk
    gpu = rng.choice(GPU_BLOCKS, size, replace=False).tolist()
    store = Job(gpu, chunks, [size], [1])
    assert worker.submit_store(1, *store.specs())
    assert finish(worker, {1})[1].success
    pages = [layout.page_bytes * BLOCKS_PER_CHUNK] * layout.layers
    with vllm_views(
        spec.settings.instance_id,
        geometry.num_chunks,
        rank,
        geometry.row_stride,
        geometry.cpu_page_size,
        pages,
        sparse=sparse,
    ) as vllm:
        assert assert_region_matches_gpu(store, kv, vllm, BLOCKS_PER_CHUNK) == size * layout.layers
        for view in vllm:
            view[chunks] = torch.randint(-128, 128, (len(chunks), view.shape[1]), dtype=torch.int8)
        others = sorted(set(range(GPU_BLOCKS)) - set(gpu))[:size]
        load = Job(others, chunks, [size], [1])
        src, dst = load.specs()
        assert worker.submit_load(2, dst, src)
        assert finish(worker, {2})[2].success
        assert_region_matches_gpu(load, kv, vllm, BLOCKS_PER_CHUNK)
    worker.shutdown()
    assert not is_held(path)


def test_padded_rows_rank_1_of_2(engine: Engine, cleanup_region: None) -> None:
    """3 layers of 1536-byte pages, 2 blocks per chunk: a 9216-byte cell per worker, rows of
    18432 bytes padded to 20480, rank 1's cell starting mid-page."""
    layout = KvLayout("padded", 3, 1536)
    spec = spec_for(engine, layout, 64 * 20480, world_size=2, rank=1)
    geometry = spec.region_geometry
    assert (geometry.num_chunks, geometry.cpu_page_size, geometry.row_stride) == (64, 9216, 20480)
    agent_region(SHM, engine.engine_id, 64, 9216, 2)
    store_check_load(spec, layout, 1, [0, 17, 63], sparse=False)


def test_segmented_sparse_region_over_two_files_gets_only_this_workers_cells(
    engine: Engine, cleanup_region: None
) -> None:
    """2.5 GiB of 512 KiB rows at TP 8: vLLM 0.33 splits it over two files; chunks in both, the
    last row too. The agent did not populate it (populate: false): rank 3 allocates its own
    cells as it attaches (so a tmpfs filled later cannot SIGBUS its stores), and no others."""
    layout = KvLayout("tiny", 4, 8192)
    spec = spec_for(engine, layout, 5 * GIB // 2, world_size=8, rank=3)
    geometry = spec.region_geometry
    files = geometry.region_layout().files(engine.engine_id)
    assert len(files) == 2 and geometry.size_bytes > 2 * GIB
    agent_region(
        SHM, engine.engine_id, geometry.num_chunks, geometry.cpu_page_size, 8, populate=False
    )
    for file in files:
        assert os.path.getsize(os.path.join(SHM, file.name)) == file.length
    last_of_first = files[0].length // geometry.row_stride - 1
    chunks = [last_of_first, last_of_first + 1, geometry.num_chunks - 1]
    store_check_load(spec, layout, 3, chunks, sparse=True)
    allocated = sum(os.stat(os.path.join(SHM, f.name)).st_blocks * 512 for f in files)
    own = geometry.num_chunks * geometry.cpu_page_size
    assert own <= allocated <= own + geometry.row_stride  # + the row vLLM's views prefault


def test_a_segmented_region_missing_a_file_is_refused_naming_it(
    engine: Engine, cleanup_region: None
) -> None:
    layout = KvLayout("tiny", 4, 8192)
    spec = spec_for(engine, layout, 5 * GIB // 2, world_size=1, rank=0)
    geometry = spec.region_geometry
    path = agent_region(
        SHM, engine.engine_id, geometry.num_chunks, geometry.cpu_page_size, 1, populate=False
    )
    os.unlink(path + ".1")
    with pytest.raises(RegionGeometryMismatch) as caught:
        spec.get_worker(canonical_kv_caches(layout, GPU_BLOCKS, "cpu"))
    message = str(caught.value)
    for part in (
        f"keeps in 2 files (vllm_offload_{engine.engine_id}.mmap, "
        f"vllm_offload_{engine.engine_id}.mmap.1)",
        f"the kvshm region file {path}.1 is missing",
        f"format: vllm-0.33, numBlocks: {geometry.num_chunks}",
    ):
        assert part in message, message
    assert not is_held(path) and not os.path.exists(path + ".1")  # nothing created


def test_a_region_with_a_file_vllm_would_not_map_is_refused(
    engine: Engine, cleanup_region: None
) -> None:
    spec = offloading_spec(engine.config, GPU_BLOCKS)
    geometry = spec.region_geometry
    path = agent_region(SHM, engine.engine_id, geometry.num_chunks, geometry.cpu_page_size, 1)
    with open(path + ".1", "wb") as extra:
        extra.truncate(4096)
    with pytest.raises(RegionGeometryMismatch, match=r"has more files \(.*\.mmap\.1 too\)"):
        spec.get_worker(canonical_kv_caches(KvLayout("tiny", 4, 8192), GPU_BLOCKS, "cpu"))
    assert not is_held(path)
    assert os.path.getsize(path + ".1") == 4096
