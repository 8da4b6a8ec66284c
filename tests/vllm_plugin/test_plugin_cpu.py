"""The plugin loaded by vLLM 0.33's own factory from flags parsed by its own EngineArgs, storing
and loading with kvshm's CPU backend against an agent-made region in /dev/shm, checked through
vLLM's own region views."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.region import RegionAttachTimeout
from kvshm.vllm.attach import RegionGeometryMismatch
from kvshm.vllm.worker import block_outer_hint
from tests.vllm_plugin.checks import assert_region_matches_gpu, finish, job_bytes
from tests.vllm_plugin.conftest import Engine
from tests.vllm_plugin.engine import (
    BLOCKS_PER_CHUNK,
    CPU_PAGE,
    GPU_BLOCKS,
    NUM_CHUNKS,
    TINY_LAYERS,
    TINY_PAGE,
    kv_cache_config,
    offloading_spec,
)
from tests.vllm_plugin.jobs import Job, random_job
from tests.vllm_plugin.layouts import (
    BLOCK_OUTER_LAYOUTS,
    REAL_LAYOUTS,
    KvLayout,
    canonical_kv_caches,
)
from tests.vllm_plugin.regions import agent_region, is_held, region_file, vllm_views

SHM = "/dev/shm"  # vLLM's SharedOffloadRegion only looks here


@pytest.fixture
def region(engine: Engine) -> Iterator[str]:
    path = agent_region(SHM, engine.engine_id, NUM_CHUNKS, CPU_PAGE, 1)
    try:
        yield path
    finally:
        Path(path).unlink(missing_ok=True)


def spec_of(engine: Engine) -> Any:
    return offloading_spec(engine.config, GPU_BLOCKS)


def views(engine: Engine) -> Any:
    return vllm_views(
        engine.engine_id, NUM_CHUNKS, 0, CPU_PAGE, CPU_PAGE, [TINY_PAGE * BLOCKS_PER_CHUNK] * 4
    )


def test_vllm_factory_loads_the_plugin_with_vllms_own_geometry(engine: Engine) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvshm.vllm.spec import KvshmOffloadingSpec

    spec = spec_of(engine)
    assert type(spec) is KvshmOffloadingSpec
    own = CPUOffloadingSpec(spec.config)  # vLLM's spec for the same engine
    assert (spec.num_chunks, spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker) == (
        own.num_chunks,
        own.kv_bytes_per_chunk,
        own.cpu_page_size_per_worker,
    )
    assert (spec.num_chunks, spec.cpu_page_size_per_worker) == (NUM_CHUNKS, CPU_PAGE)
    assert spec.settings.instance_id == engine.engine_id  # top-level engine_id reached it
    assert spec.settings.region_dir == SHM
    assert isinstance(spec.get_manager(), CPUOffloadingManager)


def test_store_and_load_partial_chunks_through_vllms_views(engine: Engine, region: str) -> None:
    from vllm.v1.kv_offload.base import TransferResult

    assert not is_held(region)
    spec = spec_of(engine)
    kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
    worker = spec.get_worker(kv)
    assert is_held(region), "the agent's holder probe does not see the engine"
    rng = np.random.default_rng(1)
    # starts one block into its first chunk and ends half-way into its last: 3 chunks
    store = random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [4], [3])
    assert len(store.cpu_ids) == 3
    whole = random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [6], [0], store.cpu_ids)
    assert worker.submit_store(1, *store.specs())
    assert worker.submit_store(2, *whole.specs())
    results = finish(worker, {1, 2})
    for job_id, job in ((1, store), (2, whole)):
        result = results[job_id]
        assert type(result) is TransferResult and result.success
        assert result.transfer_size == job_bytes(job, kv)
        assert result.transfer_time is not None and result.transfer_time >= 0
    stored = [t.tensor[store.gpu_ids].clone() for t in kv.tensors]
    with views(engine) as vllm:
        assert assert_region_matches_gpu(store, kv, vllm, BLOCKS_PER_CHUNK) == 4 * TINY_LAYERS
        assert_region_matches_gpu(whole, kv, vllm, BLOCKS_PER_CHUNK)
        # the reverse: vLLM writes chunks, the plugin loads them into fresh GPU blocks
        used = store.cpu_ids + whole.cpu_ids
        load = random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [5], [1], used)
        for view in vllm:
            fresh = torch.randint(-128, 128, (3, view.shape[1]), dtype=torch.int8)
            view[load.cpu_ids] = fresh
        gpu_before = [t.tensor.clone() for t in kv.tensors]
        src, dst = load.specs()
        assert worker.submit_load(3, dst, src, expedited=True)
        assert finish(worker, {3})[3].success
        assert_region_matches_gpu(load, kv, vllm, BLOCKS_PER_CHUNK)
        untouched = sorted(set(range(GPU_BLOCKS)) - set(load.gpu_ids))
        for before, t in zip(gpu_before, kv.tensors, strict=True):
            assert torch.equal(before[untouched], t.tensor[untouched])
    # a regular load of the first store's chunks into other blocks gives the stored bytes back
    back = Job(sorted(set(range(GPU_BLOCKS)) - set(store.gpu_ids))[:4], store.cpu_ids, [4], [3])
    src, dst = back.specs()
    assert worker.submit_load(4, dst, src)
    assert finish(worker, {4})[4].success
    for before, t in zip(stored, kv.tensors, strict=True):
        assert torch.equal(t.tensor[back.gpu_ids], before)
    worker.shutdown()
    assert not is_held(region), "the engine still holds the region after shutdown"
    assert os.path.exists(region), "the plugin removed the agent's region"


def test_several_groups_with_partial_and_empty_groups(engine: Engine, region: str) -> None:
    spec = spec_of(engine)
    kv = canonical_kv_caches(
        KvLayout("tiny-2g", TINY_LAYERS, TINY_PAGE, groups=2), GPU_BLOCKS, "cpu"
    )
    worker = spec.get_worker(kv)
    rng = np.random.default_rng(2)
    jobs = [
        random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [3, 2], [1, 4]),
        random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [0, 3], [0, 5]),
    ]
    for job_id, job in enumerate(jobs, start=1):
        assert worker.submit_store(job_id, *job.specs())
        assert finish(worker, {job_id})[job_id].transfer_size == job_bytes(job, kv)
        with views(engine) as vllm:
            assert_region_matches_gpu(job, kv, vllm, BLOCKS_PER_CHUNK)
    worker.shutdown()


def test_block_outer_kv_cache_through_vllms_connector_worker(engine: Engine, region: str) -> None:
    """With a block-outer KV cache (VLLM_KV_CACHE_LAYOUT=BLHNC) vLLM's own connector worker
    hands the spec one tensor whose page is a whole block, its layers back to back: the
    plugin stores and loads it, and each cell holds the block as it lies on the GPU."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    config = copy.copy(engine.config)
    config.cache_config = copy.copy(engine.config.cache_config)
    config.cache_config.kv_cache_layout = "BLHNC"  # as the engine core resolves it
    kv_config = kv_cache_config(GPU_BLOCKS, block_outer=True)
    backing = torch.randint(-128, 128, (GPU_BLOCKS, TINY_LAYERS, TINY_PAGE), dtype=torch.int8)
    (group,) = kv_config.kv_cache_groups
    connector = OffloadingConnectorWorker(
        offloading_spec(config, GPU_BLOCKS, kv_config), config, kv_config
    )
    connector.register_kv_caches({name: backing[:, i] for i, name in enumerate(group.layer_names)})
    worker = connector.worker
    block = TINY_LAYERS * TINY_PAGE
    rng = np.random.default_rng(4)
    store = random_job(rng, GPU_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK, [5], [1])
    assert worker.submit_store(1, *store.specs())
    result = finish(worker, {1})[1]
    assert result.success and result.transfer_size == 5 * block
    with vllm_views(engine.engine_id, NUM_CHUNKS, 0, CPU_PAGE, CPU_PAGE, [CPU_PAGE]) as (view,):
        for _, gpu_block, chunk, sub in store.placements(BLOCKS_PER_CHUNK):
            cell = view[chunk, sub * block : (sub + 1) * block]
            assert torch.equal(cell, backing[gpu_block].reshape(-1)), f"GPU block {gpu_block}"
    free = sorted(set(range(GPU_BLOCKS)) - set(store.gpu_ids))[:5]
    back = Job(free, store.cpu_ids, [5], [1])
    src, dst = back.specs()
    assert worker.submit_load(2, dst, src)
    assert finish(worker, {2})[2].success
    assert torch.equal(backing[free], backing[store.gpu_ids])
    worker.shutdown()


@pytest.mark.parametrize(
    "layout", [*REAL_LAYOUTS, *BLOCK_OUTER_LAYOUTS], ids=lambda layout: layout.name
)
def test_layer_pages_that_would_be_staged_get_the_block_outer_hint(layout: KvLayout) -> None:
    hint = block_outer_hint(layout.tensor_pages)
    staged = not layout.block_outer and layout.page_bytes < 128 * 1024
    assert (hint is not None) == staged
    if hint is not None:
        assert f"{layout.layers} KV tensors of {layout.page_bytes // 1024} KiB pages" in hint
        assert "VLLM_KV_CACHE_LAYOUT=BLHNC" in hint and "kvshm_backend: copy-engines" in hint
        # Llama-3.1-70B at TP 4: 80 x 16 KiB = 1280 KiB a block, which an H100 reads slower
        aliased = layout.worker_bytes_per_block % (320 * 1024) == 0
        assert ("decodes up to 18 % slower" in hint) == aliased
        assert ("decodes it as fast" in hint) == (not aliased)
        assert aliased == (layout.name == "llama-3.1-70b-tp4-rank0")


def test_a_region_of_another_geometry_is_refused_naming_both(engine: Engine) -> None:
    path = agent_region(SHM, engine.engine_id, NUM_CHUNKS * 2, CPU_PAGE, 1)
    try:
        kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
        with pytest.raises(RegionGeometryMismatch) as caught:
            spec_of(engine).get_worker(kv)
        message = str(caught.value)
        for part in (
            f"vLLM computed a CPU offload region of {NUM_CHUNKS} rows x {CPU_PAGE} bytes",
            f"keeps in 1 file (vllm_offload_{engine.engine_id}.mmap)",
            f"{path} is {2 * NUM_CHUNKS * CPU_PAGE} bytes where vLLM expects "
            f"{NUM_CHUNKS * CPU_PAGE}; in all, {SHM} holds 1 file of the region "
            f"(vllm_offload_{engine.engine_id}.mmap): {2 * NUM_CHUNKS * CPU_PAGE} bytes, "
            f"{2 * NUM_CHUNKS} rows of {CPU_PAGE} bytes.",
            f"OffloadRegion with instanceId {engine.engine_id!r}",
            f"format: vllm-0.33, numBlocks: {NUM_CHUNKS}, cpuPageSize: {CPU_PAGE}, "
            "numWorkers: 1, replicated: false",
        ):
            assert part in message, message
        assert not is_held(path)
        assert os.path.getsize(path) == 2 * NUM_CHUNKS * CPU_PAGE  # left as it was
    finally:
        Path(path).unlink(missing_ok=True)


def test_never_creates_a_missing_region(engine: Engine) -> None:
    spec = spec_of(engine)
    spec.settings = dataclasses.replace(spec.settings, attach_timeout_s=0.2)
    kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
    with pytest.raises(RegionAttachTimeout, match="did not appear"):
        spec.get_worker(kv)
    assert not os.path.exists(region_file(SHM, engine.engine_id))


def test_replicated_layout_every_rank_uses_the_one_copy(engine: Engine) -> None:
    """MLA's replicated layout at TP 2: one copy per row, which rank 1 maps and loads too."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvshm.vllm.spec import KvshmOffloadingSpec

    base = spec_of(engine).config
    config = dataclasses.replace(
        base,
        replicated_layout=True,
        parallel=dataclasses.replace(base.parallel, world_size=2, tp_size=2, rank=1),
    )

    class VllmOnCuda(CPUOffloadingSpec):  # type: ignore[misc]
        def _uses_shared_region(self) -> bool:
            return True  # what vLLM's spec decides on a CUDA platform

    spec, own = KvshmOffloadingSpec(config), VllmOnCuda(config)
    assert spec.replicated_layout and own.replicated_layout
    geometry = spec.region_geometry
    assert (geometry.num_chunks, geometry.row_stride, geometry.cpu_page_size) == (
        own.num_chunks,
        own.kv_bytes_per_chunk,
        own.cpu_page_size_per_worker,
    )
    assert geometry.copies == 1 and geometry.row_stride == CPU_PAGE
    path = agent_region(SHM, engine.engine_id, geometry.num_chunks, CPU_PAGE, 2, replicated=True)
    try:
        kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
        worker = spec.get_worker(kv)  # rank 1
        job = random_job(np.random.default_rng(3), GPU_BLOCKS, geometry.num_chunks, 2, [5], [1])
        assert worker.submit_store(1, *job.specs())
        assert finish(worker, {1})[1].success
        pages = [TINY_PAGE * BLOCKS_PER_CHUNK] * TINY_LAYERS
        # vLLM's create_worker maps the replicated region as rank 0 on every worker
        with vllm_views(engine.engine_id, geometry.num_chunks, 0, CPU_PAGE, CPU_PAGE, pages) as v:
            assert_region_matches_gpu(job, kv, v, BLOCKS_PER_CHUNK)
        worker.shutdown()
    finally:
        Path(path).unlink(missing_ok=True)


SECONDS = "kvshm_attach_timeout_s must be a finite number of seconds >= 0, got "
CACHE_DIR = "kvshm_cache_dir must be an absolute path, got "


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvshm_region_dir": "relative/dir"}, "must be an absolute path, got 'relative/dir'"),
        ({"kvshm_region_dir": 7}, "kvshm_region_dir must be an absolute path, got 7"),
        ({"kvshm_instance_id": "../escape"}, "kvshm_instance_id '../escape' is no region instance"),
        (
            {"kvshm_instance_id": 12},
            "kvshm_instance_id must be a string (the region's instanceId), got 12",
        ),
        ({"kvshm_attach_timeout_s": "soon"}, SECONDS + "'soon'"),
        ({"kvshm_attach_timeout_s": True}, SECONDS + "True"),
        ({"kvshm_attach_timeout_s": -1}, SECONDS + "-1"),
        ({"kvshm_attach_timeout_s": "nan"}, SECONDS + "'nan'"),
        # would wait forever for a region that is not there
        ({"kvshm_attach_timeout_s": "inf"}, SECONDS + "'inf'"),
        ({"kvshm_attach_timeout_s": float("inf")}, SECONDS + "inf"),
        (
            {"kvshm_backend": "fastest"},
            "must be one of auto, copy-engines, dma, kernel, staged, strided, cpu",
        ),
        ({"kvshm_pin": "maybe"}, "kvshm_pin must be true or false"),
        # YAML's false read as "no cache" would have cached under ./False
        ({"kvshm_cache_dir": False}, CACHE_DIR + "False; leave it out for ~/.cache/kvshm"),
        ({"kvshm_cache_dir": "cache"}, CACHE_DIR + "'cache'"),
        ({"kvshm_cache_dir": ["/a"]}, CACHE_DIR + "['/a']"),
        (
            {"kvshm_calibrat": False, "kvshm_pin": True},
            "unknown kvshm keys in kv_connector_extra_config: kvshm_calibrat; the plugin's keys "
            "are kvshm_region_dir, kvshm_instance_id, kvshm_attach_timeout_s, kvshm_backend, "
            "kvshm_pin, kvshm_calibrate, kvshm_cache_dir",
        ),
    ],
)
def test_bad_plugin_keys_are_refused_at_start(
    engine: Engine, extra: dict[str, Any], message: str
) -> None:
    from kvshm.vllm.settings import PluginConfigError, PluginSettings

    with pytest.raises(PluginConfigError, match=re.escape(message)):
        PluginSettings.from_extra_config(extra, engine.engine_id, 0, 1)


def test_an_engine_id_that_is_no_instance_id_is_refused_naming_the_key_to_set() -> None:
    from kvshm.vllm.settings import PluginConfigError, PluginSettings

    message = "vLLM's engine_id 'a/b' (set kvshm_instance_id to the region's) is no region"
    with pytest.raises(PluginConfigError, match=re.escape(message)):
        PluginSettings.from_extra_config({}, "a/b", 0, 1)


def test_good_plugin_keys_beside_vllms_own_are_taken() -> None:
    from kvshm.vllm.settings import PluginSettings

    extra = {
        "spec_name": "KvshmOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "kvshm_cache_dir": "/kvshm/cache",
        "kvshm_attach_timeout_s": "2.5",
        "kvshm_calibrate": "false",
    }
    settings = PluginSettings.from_extra_config(extra, "engine", 0, 1)
    assert (settings.cache_dir, settings.attach_timeout_s, settings.calibrate) == (
        "/kvshm/cache",
        2.5,
        False,
    )
    assert PluginSettings.from_extra_config({}, "engine", 0, 1).cache_dir is None


def test_an_explicit_instance_id_gets_vllms_data_parallel_suffix(engine: Engine) -> None:
    from kvshm.vllm.settings import PluginSettings

    extra = {"kvshm_instance_id": "llama-kv"}
    assert PluginSettings.from_extra_config(extra, "x_dp1", 1, 2).instance_id == "llama-kv_dp1"
    assert PluginSettings.from_extra_config(extra, "x", 0, 1).instance_id == "llama-kv"
    assert PluginSettings.from_extra_config({}, "x_dp1", 1, 2).instance_id == "x_dp1"


def test_canonical_layout_is_refused_clearly(engine: Engine) -> None:
    from kvshm.vllm.settings import PluginConfigError
    from kvshm.vllm.spec import KvshmOffloadingSpec

    config = dataclasses.replace(spec_of(engine).config, canonical_layout=True)
    with pytest.raises(PluginConfigError, match="canonical_layout is not supported"):
        KvshmOffloadingSpec(config)
