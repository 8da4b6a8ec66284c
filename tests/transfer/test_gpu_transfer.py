"""GPU round trips through a pinned 4-worker region, for every backend and block size."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.region import SharedOffloadRegion
from kvshm.transfer import (
    BackendUnavailableError,
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    HandlerLayout,
    SingleDirectionOffloadingHandler,
    TransferOptions,
)
from kvshm.transfer.backends.kernel import CompiledLaunch, KernelBackend
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.backends.strided import StridedBackend
from kvshm.transfer.cuda.streams import own_stream

from .helpers import open_region, placements, region_bytes, unpadded

pytestmark = pytest.mark.gpu

SHM = "/dev/shm"
KIB = 1024
BLOCK_SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 2048 * KIB]
BACKENDS: dict[str, dict[str, Any]] = {
    "dma": {"backend": "dma"},
    "dma-each": {"backend": "dma", "options": TransferOptions(use_batch_call=False)},
    "kernel": {"backend": "kernel"},
    "staged": {"backend": "staged"},
    "auto": {},
}


@pytest.fixture
def regions(request: pytest.FixtureRequest) -> Iterator[list[SharedOffloadRegion]]:
    """Four ranks of one region, each attached (and pinned) like a worker process would."""
    num_blocks, cell = request.param
    instance = f"gpu-{uuid.uuid4().hex[:12]}"
    opened = [
        open_region(SHM, unpadded(num_blocks, cell, 4), r, instance_id=instance) for r in range(4)
    ]
    yield opened
    for region in reversed(opened):
        region.cleanup()


def random_block_data(blocks: int, width: int, count: int) -> list[torch.Tensor]:
    return [
        torch.randint(-128, 128, (blocks, width), dtype=torch.int8, device="cuda")
        for _ in range(count)
    ]


def store_and_load(
    gpu: Sequence[torch.Tensor],
    region: SharedOffloadRegion,
    factor: int,
    refs: Any,
    **kwargs: Any,
) -> tuple[SingleDirectionOffloadingHandler, SingleDirectionOffloadingHandler]:
    """A store and a load handler over this rank's views of the region, built as the plugin's
    assembly builds each, the region registered first as the plugin's worker has it by its
    first transfer (kwargs: backend=, options= for both)."""
    region.pin()
    layout = HandlerLayout.over_region(gpu, region, factor, refs)
    return layout.handler(True, **kwargs), layout.handler(False, **kwargs)


def shut_down(*handlers: SingleDirectionOffloadingHandler) -> None:
    for handler in handlers:
        handler.shutdown()


def run(handler: Any, job_id: int, spec: Any) -> None:
    assert handler.transfer_async(job_id, spec)
    handler.wait([job_id])
    [result] = handler.get_finished()
    assert (result.job_id, result.success) == (job_id, True)


def loads_back_exactly(
    load: Any, gpu: list[torch.Tensor], sent: torch.Tensor, cpu_ids: Any, load_to: Any, fill: int
) -> None:
    """Fill the GPU tensors with `fill`, load cells cpu_ids into blocks load_to, and check
    those hold what blocks `sent` held before, every other block still `fill`."""
    originals = [t[sent].clone() for t in gpu]
    for tensor in gpu:
        tensor.fill_(fill)
    count = len(load_to)
    run(load, 2, (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(load_to, [count], [0])))
    targets = torch.from_numpy(load_to).cuda()
    untouched = torch.from_numpy(np.setdiff1d(np.arange(gpu[0].shape[0]), load_to)).cuda()
    for tensor, original in zip(gpu, originals, strict=True):
        assert torch.equal(tensor[targets], original)
        assert bool((tensor[untouched] == fill).all())


def region_params(block: int) -> tuple[int, int]:
    return max(8, min(128, 32 * 1024 * KIB // (8 * block))), 2 * block


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("block", "regions"),
    [(b, region_params(b)) for b in BLOCK_SIZES],
    indirect=["regions"],
    ids=[f"{b // KIB}KiB" for b in BLOCK_SIZES],
)
def test_round_trip_is_byte_exact(
    backend: str, block: int, regions: list[SharedOffloadRegion]
) -> None:
    num_blocks = regions[0].layout.num_blocks
    refs = [[CanonicalKVCacheRef(0, block), CanonicalKVCacheRef(1, block)]]
    rng = np.random.default_rng(block)
    workers = []
    for region in regions:
        gpu = random_block_data(num_blocks + 8, block, 2)
        store, load = store_and_load(gpu, region, 1, refs, **BACKENDS[backend])
        assert region.is_pinned
        gpu_ids = rng.permutation(num_blocks + 8)[:num_blocks]
        cpu_ids = rng.permutation(num_blocks)
        spec = (GPULoadStoreSpec(gpu_ids, [num_blocks], [0]), CPULoadStoreSpec(cpu_ids))
        run(store, 1, spec)
        workers.append(((store, load), gpu, gpu_ids, cpu_ids))

    rows = region_bytes(regions[0])
    for rank, (_, gpu, gpu_ids, cpu_ids) in enumerate(workers):
        cell = rows[cpu_ids, rank * 2 * block : (rank + 1) * 2 * block]
        for t in range(2):
            sent = gpu[t][torch.from_numpy(gpu_ids).cuda()].cpu().numpy().view(np.uint8)
            assert np.array_equal(cell[:, t * block : (t + 1) * block], sent), (rank, t)

    for (store, load), gpu, gpu_ids, cpu_ids in workers:
        originals = [t[torch.from_numpy(gpu_ids).cuda()].clone() for t in gpu]
        for tensor in gpu:
            tensor.fill_(0x33)
        load_to = rng.permutation(num_blocks + 8)[:num_blocks]
        spec = (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(load_to, [num_blocks], [0]))
        run(load, 2, spec)
        for tensor, original in zip(gpu, originals, strict=True):
            assert torch.equal(tensor[torch.from_numpy(load_to).cuda()], original)
            untouched = np.setdiff1d(np.arange(num_blocks + 8), load_to)
            assert bool((tensor[torch.from_numpy(untouched).cuda()] == 0x33).all())
        shut_down(store, load)


@pytest.mark.parametrize("tensors", [1, 4], ids=["block-outer", "four-tensors"])
@pytest.mark.parametrize("regions", [(32, 1024 * KIB)], indirect=True)
def test_uniform_dma_jobs_take_their_tables_from_the_ids_byte_exact(
    tensors: int, regions: list[SharedOffloadRegion], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the copy engines take every job of a uniform layout (a block-outer cache's one
    page a block, or large pages), the handler builds the DMA table from the ids without the
    general planner (docs/transfer.md F49), and every byte lands both ways."""
    page, region, rank = 1024 * KIB // tensors, regions[2], 2
    gpu = random_block_data(40, page, tensors)
    refs = [[CanonicalKVCacheRef(t, page) for t in range(tensors)]]
    store, load = store_and_load(gpu, region, 1, refs)

    def planned(spec: object) -> None:
        raise AssertionError("a uniform DMA job went to the general planner")

    for handler in (store, load):
        uniform = handler._router.uniform_backend(None)
        assert uniform is not None and uniform.name == "dma"
        monkeypatch.setattr(handler._planner, "plan", planned)
    rng = np.random.default_rng(tensors)
    gpu_ids, cpu_ids = rng.permutation(40)[:24], rng.permutation(32)[:24]
    run(store, 1, (GPULoadStoreSpec(gpu_ids, [24], [0]), CPULoadStoreSpec(cpu_ids)))
    cells = region_bytes(region)[cpu_ids, rank * tensors * page : (rank + 1) * tensors * page]
    ids = torch.from_numpy(gpu_ids).cuda()
    for t in range(tensors):
        sent = gpu[t][ids].cpu().numpy().view(np.uint8)
        assert np.array_equal(cells[:, t * page : (t + 1) * page], sent), t
    loads_back_exactly(load, gpu, ids, cpu_ids, rng.permutation(40)[:24], 0x21)
    shut_down(store, load)


GROUP_REFS = [
    [CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 4096)],
    [CanonicalKVCacheRef(2, 2048)],
]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("regions", [(24, 3 * 4 * 4096 + 4096)], indirect=True)
def test_groups_with_partial_cpu_blocks(backend: str, regions: list[SharedOffloadRegion]) -> None:
    factor, sizes, starts = 4, [6, 5], [3, 5]
    region = regions[1]
    gpu = random_block_data(40, 4096, 3)
    store, load = store_and_load(gpu, region, factor, GROUP_REFS, **BACKENDS[backend])
    rng = np.random.default_rng(7)
    gpu_ids = rng.permutation(40)[:11]
    cpu_ids = rng.permutation(24)[:5]
    before = region_bytes(region).copy()
    run(
        store,
        1,
        (GPULoadStoreSpec(gpu_ids, sizes, starts), CPULoadStoreSpec(cpu_ids)),
    )

    expected = before
    host = [t.cpu().numpy().view(np.uint8) for t in gpu]
    for p in placements(gpu_ids, cpu_ids, sizes, starts, GROUP_REFS, factor):
        at = region.layout.cpu_page_size + p.tensor * 4 * 4096 + p.slot * 4096
        expected[p.cpu_id, at : at + p.size] = host[p.tensor][p.gpu_id, : p.size]
    assert np.array_equal(region_bytes(region), expected)

    for tensor in gpu:
        tensor.zero_()
    run(
        load,
        2,
        (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids, sizes, starts)),
    )
    for p in placements(gpu_ids, cpu_ids, sizes, starts, GROUP_REFS, factor):
        got = gpu[p.tensor][p.gpu_id].cpu().numpy().view(np.uint8)
        assert np.array_equal(got[: p.size], host[p.tensor][p.gpu_id, : p.size])
        assert not got[p.size :].any()
    shut_down(store, load)


@pytest.mark.parametrize("backend", ["auto", "staged"])
@pytest.mark.parametrize("stream_per_job", [False, True], ids=["one-stream", "stream-per-job"])
@pytest.mark.parametrize("regions", [(64, 1024 * KIB)], indirect=True)
def test_jobs_finish_in_order_while_another_stream_computes(
    regions: list[SharedOffloadRegion], stream_per_job: bool, backend: str
) -> None:
    region = regions[0]
    block = 1024 * KIB
    gpu = random_block_data(64, block, 1)
    options = TransferOptions(stream_per_job=stream_per_job)
    refs = [[CanonicalKVCacheRef(0, block)]]
    store, load = store_and_load(gpu, region, 1, refs, options=options, **BACKENDS[backend])
    compute = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    fresh = torch.randint(-128, 128, (8, block), dtype=torch.int8, device="cuda")
    # a job under the default stream first: each job must follow the stream current at its
    # own submission, not one the handler saw before
    assert store.transfer_async(99, (GPULoadStoreSpec([9], [1], [0]), CPULoadStoreSpec([9])))
    store.wait([99])
    assert [r.job_id for r in store.get_finished()] == [99]
    with torch.cuda.stream(compute):
        for _ in range(100):  # about 0.1 s of matrix products
            torch.mm(a, a)
        gpu[0][:8].copy_(fresh)  # written by the compute stream, after all that
        for job in range(8):  # submitted with the compute stream current
            spec = (GPULoadStoreSpec([job], [1], [0]), CPULoadStoreSpec([job]))
            assert store.transfer_async(job, spec)
    assert store.get_finished() == []  # still behind the compute stream
    finished: list[int] = []
    while len(finished) < 8:
        finished += [r.job_id for r in store.get_finished()]
    assert finished == list(range(8))
    rows = region_bytes(region)
    assert np.array_equal(rows[:8, :block], fresh.cpu().numpy().view(np.uint8))

    # loads: each job overwrites GPU block 0; only in-order execution leaves the last one there
    with torch.cuda.stream(compute):
        for _ in range(50):
            torch.mm(a, a)
    for job in range(8):
        assert load.transfer_async(
            100 + job, (CPULoadStoreSpec([job]), GPULoadStoreSpec([0], [1], [0]))
        )
    load.wait([107])
    assert [r.job_id for r in load.get_finished()] == [100 + j for j in range(8)]
    assert torch.equal(gpu[0][0], fresh[7])
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(8, 64 * KIB)], indirect=True)
def test_unpinned_region_copies_by_dma_and_refuses_the_kernel(
    regions: list[SharedOffloadRegion],
) -> None:
    region = regions[0]
    gpu = random_block_data(8, 64 * KIB, 1)
    refs = [[CanonicalKVCacheRef(0, 64 * KIB)]]
    with pytest.raises(BackendUnavailableError, match="not registered with CUDA"):
        HandlerLayout.over_region(gpu, region, 1, refs).handler(True, backend="kernel")
    other = regions[1]
    layout = HandlerLayout.over_region(gpu, other, 1, refs)
    store, load = layout.handler(True), layout.handler(False)
    assert not other.is_pinned
    assert store.backends == ["dma"]
    ids = np.arange(8)
    run(store, 1, (GPULoadStoreSpec(ids, [8], [0]), CPULoadStoreSpec(ids)))
    rows = region_bytes(other)
    assert np.array_equal(rows[:, 64 * KIB : 128 * KIB], gpu[0].cpu().numpy().view(np.uint8))
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(32, 8 * 16 * KIB)], indirect=True)
def test_a_layer_outer_cache_in_one_allocation_moves_by_2d_copies_byte_exact(
    regions: list[SharedOffloadRegion], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33's layout: one allocation, layer l's pages from l * blocks * page on."""
    layers, page, blocks, count = 8, 16 * KIB, 48, 32
    region = regions[0]
    backing = torch.randint(-128, 128, (layers, blocks, page), dtype=torch.int8, device="cuda")
    refs = [[CanonicalKVCacheRef(layer, page) for layer in range(layers)]]
    calls: list[int] = []
    copy_uniform = StridedBackend.copy_uniform

    def counted(self: StridedBackend, job: Any, stream: Any, after: Any = None) -> None:
        calls.append(len(job.gpu_ids))
        copy_uniform(self, job, stream, after)

    monkeypatch.setattr(StridedBackend, "copy_uniform", counted)
    store, load = store_and_load(list(backing), region, 1, refs, backend="strided")
    rng = np.random.default_rng(7)
    gpu_ids, cpu_ids = rng.permutation(blocks)[:count], rng.permutation(count)
    gpu_spec = GPULoadStoreSpec(gpu_ids, [count], [0])
    run(store, 1, (gpu_spec, CPULoadStoreSpec(cpu_ids)))
    on_gpu = torch.from_numpy(gpu_ids).cuda()
    sent = backing[:, on_gpu].permute(1, 0, 2).reshape(count, -1).cpu().numpy().view(np.uint8)
    assert np.array_equal(region_bytes(region)[cpu_ids, : layers * page], sent)
    original = backing.clone()
    backing.fill_(0x33)
    run(load, 2, (CPULoadStoreSpec(cpu_ids), gpu_spec))
    assert torch.equal(backing[:, on_gpu], original[:, on_gpu])
    untouched = torch.from_numpy(np.setdiff1d(np.arange(blocks), gpu_ids)).cuda()
    assert bool((backing[:, untouched] == 0x33).all())
    assert calls == [count, count]  # each job by one 2-D copy a block, not by DMA
    shut_down(store, load)


@pytest.mark.parametrize("direct", [True, False], ids=["direct-launch", "triton-jit"])
@pytest.mark.parametrize("regions", [(32, 2 * 16 * KIB)], indirect=True)
def test_copy_kernel_launches_directly_or_through_triton_byte_exact(
    direct: bool, regions: list[SharedOffloadRegion], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel backend launches its compiled kernel directly where its self-test passes
    (this Triton); where that launch fails, it falls back to Triton's and still copies."""
    if not direct:

        def changed_interface(*args: object, **kwargs: object) -> None:
            raise TypeError("a launcher that takes other arguments")

        monkeypatch.setattr(CompiledLaunch, "__call__", changed_interface)
    assert (KernelBackend(torch.device("cuda", 0))._direct is not None) == direct
    region = regions[0]
    gpu = random_block_data(40, 16 * KIB, 2)
    refs = [[CanonicalKVCacheRef(0, 16 * KIB), CanonicalKVCacheRef(1, 16 * KIB)]]
    store, load = store_and_load(gpu, region, 1, refs, backend="kernel")
    rng = np.random.default_rng(7)
    gpu_ids, cpu_ids = rng.permutation(40)[:32], rng.permutation(32)
    run(
        store,
        1,
        (GPULoadStoreSpec(gpu_ids, [32], [0]), CPULoadStoreSpec(cpu_ids)),
    )
    cell = region_bytes(region)[cpu_ids, : 2 * 16 * KIB]
    for t in range(2):
        sent = gpu[t][torch.from_numpy(gpu_ids).cuda()].cpu().numpy().view(np.uint8)
        assert np.array_equal(cell[:, t * 16 * KIB : (t + 1) * 16 * KIB], sent)
    originals = [t[torch.from_numpy(gpu_ids).cuda()].clone() for t in gpu]
    for tensor in gpu:
        tensor.zero_()
    run(
        load,
        2,
        (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids, [32], [0])),
    )
    for tensor, original in zip(gpu, originals, strict=True):
        assert torch.equal(tensor[torch.from_numpy(gpu_ids).cuda()], original)
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(64, 2 * 16 * KIB)], indirect=True)
def test_kernel_jobs_borrow_a_pinned_table_and_give_it_back(
    regions: list[SharedOffloadRegion],
) -> None:
    """A kernel-backend job reads its descriptors from a pinned table lent until the job is
    retired: the next job, with other rows, borrows the same table and lands every byte."""
    region = regions[0]
    gpu = random_block_data(64, 16 * KIB, 2)
    refs = [[CanonicalKVCacheRef(0, 16 * KIB), CanonicalKVCacheRef(1, 16 * KIB)]]
    store, load = store_and_load(gpu, region, 1, refs, backend="kernel")
    rng = np.random.default_rng(13)
    lent = []
    for job in range(2):
        gpu_ids, cpu_ids = rng.permutation(64)[:24], rng.permutation(64)[:24]
        spec = (GPULoadStoreSpec(gpu_ids, [24], [0]), CPULoadStoreSpec(cpu_ids))
        assert store.transfer_async(job, spec)
        lent.append(store._jobs[-1].ticket.keep)
        store.wait([job])
        assert [(r.job_id, r.success) for r in store.get_finished()] == [(job, True)]
        cell = region_bytes(region)[cpu_ids, : 2 * 16 * KIB]
        for t in range(2):
            sent = gpu[t][torch.from_numpy(gpu_ids).cuda()].cpu().numpy().view(np.uint8)
            assert np.array_equal(cell[:, t * 16 * KIB : (t + 1) * 16 * KIB], sent)
    assert lent[0] is lent[1] is not None  # given back when retired, lent again
    shut_down(store, load)


def test_a_hook_on_tritons_launches_sees_the_copy_kernel() -> None:
    """Launched directly, the kernel skips Triton's per-launch hook calls; once a profiler
    hooks Triton's launches, they go through Triton's own path, which calls it."""
    from triton import knobs

    backend = KernelBackend(torch.device("cuda", 0))
    direct = backend._direct
    assert direct is not None and direct.handles is not None and not direct.hooks_listening()
    data = torch.arange(64, dtype=torch.uint8, device="cuda")
    at = data.data_ptr()
    seen: list[object] = []

    def hook(metadata: object) -> None:
        seen.append(metadata)

    for hooked, (src, dst) in ((False, (0, 32)), (True, (16, 48))):
        if hooked:
            knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert direct.hooks_listening() == hooked
            table = torch.tensor([[at + src], [at + dst], [16]], dtype=torch.int64).pin_memory()
            backend.launch(table, 0, 1, 16)
            torch.cuda.synchronize()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert torch.equal(data[dst : dst + 16], data[src : src + 16])
        assert len(seen) == int(hooked)


LAYERS = 32
PAGE = 16 * KIB


@pytest.mark.parametrize("regions", [(96, LAYERS * PAGE)], indirect=True)
def test_many_layers_of_small_pages_are_staged_and_byte_exact(
    regions: list[SharedOffloadRegion],
) -> None:
    """A worker with one tensor per layer: each block's pages form one 512 KiB run of its
    cell, so the policy stages the job (on the uniform path); jobs larger than the staging
    ring reuse its buffers."""
    region = regions[2]
    num_blocks = region.layout.num_blocks
    gpu = random_block_data(num_blocks + 16, PAGE, LAYERS)
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    options = TransferOptions(staging_buffer_bytes=2 * 1024 * KIB, staging_buffers=2)
    store, load = store_and_load(gpu, region, 1, refs, options=options)
    rng = np.random.default_rng(3)
    gpu_ids = rng.permutation(num_blocks + 16)[:num_blocks]
    cpu_ids = rng.permutation(num_blocks)
    halves = np.array_split(np.arange(num_blocks), 2)
    specs = [
        (GPULoadStoreSpec(gpu_ids[h], [len(h)], [0]), CPULoadStoreSpec(cpu_ids[h])) for h in halves
    ]
    assert store._chooser.choose(store._planner.plan(specs[0])).name == "staged"
    # one group, one block per chunk, pages back to back in the cell: the jobs are planned
    # from their ids alone (kvshm.transfer.jobs.uniform), in pieces of 4 cells per buffer
    for handler in (store, load):
        uniform = handler._router.uniform_backend(None)
        assert uniform is not None and uniform.name == "staged"
    for job, spec in enumerate(specs):
        assert store.transfer_async(job, spec)
    store.wait([0, 1])
    assert [(r.job_id, r.success) for r in store.get_finished()] == [(0, True), (1, True)]
    rows = region_bytes(region)
    cells = rows[cpu_ids, 2 * LAYERS * PAGE : 3 * LAYERS * PAGE].reshape(num_blocks, LAYERS, PAGE)
    ids = torch.from_numpy(gpu_ids).cuda()
    for t in range(LAYERS):
        assert np.array_equal(cells[:, t], gpu[t][ids].cpu().numpy().view(np.uint8)), t
    assert not rows[:, : 2 * LAYERS * PAGE].any()  # other workers' cells untouched

    originals = [t[ids].clone() for t in gpu]
    for tensor in gpu:
        tensor.fill_(0x5A)
    load_to = rng.permutation(num_blocks + 16)[:num_blocks]
    spec = (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(load_to, [num_blocks], [0]))
    assert load._chooser.choose(load._planner.plan(spec)).name == "staged"
    run(load, 7, spec)
    targets = torch.from_numpy(load_to).cuda()
    for tensor, original in zip(gpu, originals, strict=True):
        assert torch.equal(tensor[targets], original)
    shut_down(store, load)


@pytest.mark.parametrize("path", ["uniform", "general"])
@pytest.mark.parametrize("regions", [(64, LAYERS * PAGE)], indirect=True)
def test_staged_jobs_reuse_their_kernel_tables_once_retired_byte_exact(
    regions: list[SharedOffloadRegion], path: str
) -> None:
    """On the table path (a layout the page kernel refuses) and on the general path (jobs
    that are not uniform), a staged job borrows its pinned kernel table: a second round of
    stores, with other data and other rows, reuses the first round's tables and still lands
    every byte where it belongs."""
    region = regions[0]
    gpu = random_block_data(64, PAGE, LAYERS)
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    store, load = store_and_load(gpu, region, 1, refs, backend="staged")
    staged = store._router.uniform_backend("staged")
    assert isinstance(staged, StagedBackend)
    if path == "uniform":
        staged._pages = None  # as prepare_uniform leaves it for a layout the page kernel refuses
    else:
        store._router._uniform.clear()  # as for a layout with several groups or partial blocks
    tables = staged._tables
    rng = np.random.default_rng(11)
    lent = []
    for round_ in range(2):
        for tensor in gpu:
            tensor.random_(-128, 128)
        gpu_ids, cpu_ids = rng.permutation(64)[:32], rng.permutation(64)[:32]
        quarters = np.array_split(np.arange(32), 4)
        for job, q in enumerate(quarters):
            spec = (GPULoadStoreSpec(gpu_ids[q], [len(q)], [0]), CPULoadStoreSpec(cpu_ids[q]))
            assert store.backend_for(*spec) == "staged"
            assert store.transfer_async(10 * round_ + job, spec)
        lent.append({id(job.ticket.keep) for job in store._jobs})
        store.wait([10 * round_ + 3])
        assert all(r.success for r in store.get_finished())
        assert tables.bytes_kept > 0  # given back as the jobs retired
        rows = region_bytes(region)[cpu_ids, : LAYERS * PAGE].reshape(32, LAYERS, PAGE)
        ids = torch.from_numpy(gpu_ids).cuda()
        for t in range(LAYERS):
            assert np.array_equal(rows[:, t], gpu[t][ids].cpu().numpy().view(np.uint8)), t
    assert len(lent[0]) == 4 and lent[1] == lent[0]  # the same four tables, lent again
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(64, LAYERS * PAGE)], indirect=True)
def test_jobs_wait_for_no_work_on_torchs_pooled_streams(
    regions: list[SharedOffloadRegion],
) -> None:
    """torch.cuda.Stream() hands out 32 pooled streams per priority in turn, so a handler's
    stream drawn from them could be the engine's compute stream, and its jobs would wait for
    all the work queued there (F41). With a long kernel queued on every pooled stream, a
    staged store and load still finish while those kernels run, and no stream the handlers
    copy on is a pooled one."""
    gpu = random_block_data(64, PAGE, LAYERS)
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    store, load = store_and_load(gpu, regions[0], 1, refs, backend="staged")
    rng = np.random.default_rng(5)
    ids = rng.permutation(64)[:16], rng.permutation(64)[:16]
    run(store, 1, (GPULoadStoreSpec(ids[0], [16], [0]), CPULoadStoreSpec(ids[1])))
    pooled = [torch.cuda.Stream(priority=p) for p in (0, -1) for _ in range(64)]
    for stream in pooled:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # about a second
    run(store, 2, (GPULoadStoreSpec(ids[0], [16], [0]), CPULoadStoreSpec(ids[1])))
    run(load, 3, (CPULoadStoreSpec(ids[1]), GPULoadStoreSpec(ids[0], [16], [0])))
    still_sleeping = sum(not stream.query() for stream in pooled)
    torch.cuda.synchronize()
    assert still_sleeping > 0
    handlers = (store, load)
    ours = {h._timeline._streams[0].cuda_stream for h in handlers}
    for handler in handlers:
        staged = handler._router.uniform_backend("staged")
        assert isinstance(staged, StagedBackend)
        ours |= {s.cuda_stream for s in (staged._fill_stream, staged._out_stream) if s}
    assert len(ours) == 5 and not ours & {stream.cuda_stream for stream in pooled}
    shut_down(store, load)
    given_back = {own_stream(torch.device("cuda")).cuda_stream for _ in range(5)}
    assert given_back == ours  # the handlers' streams, lent again after their shutdown


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through-triton"])
@pytest.mark.parametrize("regions", [(48, LAYERS * PAGE)], indirect=True)
def test_uniform_jobs_move_by_the_page_kernel_byte_exact(
    direct: bool, regions: list[SharedOffloadRegion], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uniform staged jobs address their pages from the block ids (the page kernel, no
    table per job): a job of more blocks than one launch takes (16) and than a buffer holds
    (20) lands every byte both ways, the kernel launched directly or, where its self-test
    fails, through Triton."""
    if not direct:

        def changed_interface(*args: object, **kwargs: object) -> None:
            raise TypeError("a launcher that takes other arguments")

        monkeypatch.setattr(CompiledLaunch, "__call__", changed_interface)
    region = regions[1]
    gpu = random_block_data(64, PAGE, LAYERS)
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    options = TransferOptions(staging_buffer_bytes=20 * LAYERS * PAGE, staging_buffers=2)
    store, load = store_and_load(gpu, region, 1, refs, options=options, backend="staged")
    for handler in (store, load):
        staged = handler._router.uniform_backend("staged")
        assert isinstance(staged, StagedBackend)
        assert staged._pages is not None and (staged._pages._direct is not None) == direct
    rng = np.random.default_rng(5)
    gpu_ids, cpu_ids = rng.permutation(64)[:48], rng.permutation(48)
    spec = (GPULoadStoreSpec(gpu_ids, [48], [0]), CPULoadStoreSpec(cpu_ids))
    assert store.transfer_async(1, spec)
    assert store._jobs[-1].ticket.keep is None  # nothing lent: the ids are the arguments
    store.wait([1])
    assert [(r.job_id, r.success) for r in store.get_finished()] == [(1, True)]
    rows = region_bytes(region)
    cells = rows[cpu_ids, LAYERS * PAGE : 2 * LAYERS * PAGE].reshape(48, LAYERS, PAGE)
    ids = torch.from_numpy(gpu_ids).cuda()
    for t in range(LAYERS):
        assert np.array_equal(cells[:, t], gpu[t][ids].cpu().numpy().view(np.uint8)), t
    assert not rows[:, : LAYERS * PAGE].any()  # the other workers' cells untouched

    loads_back_exactly(load, gpu, ids, cpu_ids, rng.permutation(64)[:48], 0x5A)
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(16, LAYERS * PAGE)], indirect=True)
def test_staging_buffers_that_do_not_fit_the_gpu_leave_staging_out(
    regions: list[SharedOffloadRegion],
) -> None:
    """An engine that already claimed its memory still gets working handlers."""
    region = regions[0]
    gpu = random_block_data(16, PAGE, LAYERS)
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    too_much = TransferOptions(staging_buffer_bytes=1 << 50)  # a petabyte per buffer
    store, load = store_and_load(gpu, region, 1, refs, options=too_much)
    assert "staged" not in store.backends and "kernel" in store.backends
    ids = np.arange(16)
    run(store, 1, (GPULoadStoreSpec(ids, [16], [0]), CPULoadStoreSpec(ids)))
    cells = region_bytes(region)[:, : LAYERS * PAGE].reshape(16, LAYERS, PAGE)
    assert np.array_equal(cells[:, 5], gpu[5].cpu().numpy().view(np.uint8))
    shut_down(store, load)


@pytest.mark.parametrize("regions", [(32, LAYERS * PAGE)], indirect=True)
def test_a_job_gets_the_beside_backend_while_the_other_direction_is_busy(
    regions: list[SharedOffloadRegion],
) -> None:
    """Stores by DMA while no load is in flight, staged while one is; every byte lands."""
    from kvshm.transfer import SingleDirectionOffloadingHandler as Handler
    from kvshm.transfer.choice.traffic import Traffic

    region = regions[1]
    gpu = random_block_data(32, PAGE, LAYERS)
    views = [region.create_next_view(PAGE) for _ in range(LAYERS)]
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(LAYERS)]]
    traffic = Traffic()
    store = Handler(
        gpu, views, 1, refs, True, backend="dma", backend_beside="staged", traffic=traffic
    )
    load = Handler(
        gpu, views, 1, refs, False, backend="dma", backend_beside="staged", traffic=traffic
    )
    assert {"dma", "staged"} <= set(store.backends) & set(load.backends)

    def store_job(job_id: int, gpu_ids: list[int], cpu_ids: list[int]) -> str:
        spec = (GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(cpu_ids))
        assert store.backend_for(*spec) in ("dma", "staged")
        assert store.transfer_async(job_id, *spec)
        return str(store._jobs[-1].backend)

    assert store_job(1, [0, 1, 2, 3], [10, 11, 12, 13]) == "dma"  # nothing else moving
    store.wait([1])  # (vLLM loads only blocks whose store finished)
    # a load in flight (submitted, not yet retired): the next store is staged
    assert load.transfer_async(2, CPULoadStoreSpec([10, 11]), GPULoadStoreSpec([20, 21], [2], [0]))
    assert store_job(3, [4, 5, 6, 7], [14, 15, 16, 17]) == "staged"
    store.wait([1, 3])
    load.wait([2])
    assert all(r.success for r in store.get_finished() + load.get_finished())
    assert store_job(4, [8, 9], [18, 19]) == "dma"  # the load retired
    store.wait([4])
    assert all(r.success for r in store.get_finished())
    cells = region_bytes(region)[:, LAYERS * PAGE : 2 * LAYERS * PAGE]
    cells = cells.reshape(32, LAYERS, PAGE)
    for gpu_id, cpu_id in zip([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], range(10, 20), strict=True):
        for t in (0, 17, LAYERS - 1):
            expected = gpu[t][gpu_id].cpu().numpy().view(np.uint8)
            assert np.array_equal(cells[cpu_id, t], expected), (gpu_id, t)
    for t in (0, LAYERS - 1):  # the load brought cells 10 and 11 (GPU blocks 0, 1) to 20, 21
        assert torch.equal(gpu[t][20], gpu[t][0]) and torch.equal(gpu[t][21], gpu[t][1])
    store.shutdown()
    load.shutdown()
    del views
