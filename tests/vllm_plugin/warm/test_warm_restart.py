"""Warm restart (docs/warm-restart.md) with vLLM 0.33's own scheduler-side code and block
hashing on CPU: hits across a SIGKILL, the eviction order, crash safety of the manager, and a
mismatched identity that never produces a hit."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import hashlib
import json
import logging
import os
import random
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshm.region.locks import try_lock_byte
from kvshm.region.naming import index_file_name
from tests.agent.hostile import TENANT_UID
from tests.sigkill import fork_and_kill
from tests.vllm_plugin.engine import (
    BLOCKS_PER_CHUNK,
    CPU_PAGE,
    TINY_LAYERS,
    TINY_PAGE,
    kv_cache_config,
    kv_transfer_config,
    vllm_config,
    write_model,
)
from tests.vllm_plugin.modelless import ModelLessEngine, block_pattern
from tests.vllm_plugin.regions import agent_region, remove_region, vllm_views

SHM = "/dev/shm"  # vLLM's own region views look only here
CHUNKS = 48
GPU_BLOCKS = 64
WEIGHTS = "model.safetensors"


class WarmEngine:
    """One engine's flags, model directory and region id."""

    def __init__(self, model_dir: Path, engine_id: str, config: Any) -> None:
        self.model_dir = model_dir
        self.engine_id = engine_id
        self.config = config

    def copy(self) -> Any:
        """A VllmConfig of its own (the scheduler writes num_gpu_blocks into its cache config)."""
        config = copy.copy(self.config)
        config.cache_config = copy.copy(self.config.cache_config)
        return config

    @property
    def index(self) -> Path:
        return Path(SHM) / index_file_name(self.engine_id)


@pytest.fixture(scope="module")
def warm_engine(tmp_path_factory: pytest.TempPathFactory) -> WarmEngine:
    model_dir = write_model(tmp_path_factory.mktemp("model"))
    (model_dir / WEIGHTS).write_bytes(b"the weights")
    engine_id = f"kvshm-warm-{uuid.uuid4().hex[:8]}"
    flags = kv_transfer_config(
        engine_id,
        {
            "cpu_bytes_to_use": CHUNKS * CPU_PAGE,
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            "kvshm_region_dir": SHM,
            "kvshm_calibrate": False,
            "kvshm_pin": False,
        },
    )
    return WarmEngine(model_dir, engine_id, vllm_config(model_dir, flags))


@pytest.fixture
def region(warm_engine: WarmEngine) -> Iterator[str]:
    warm_engine.index.unlink(missing_ok=True)
    path = agent_region(SHM, warm_engine.engine_id, CHUNKS, CPU_PAGE, 1)
    try:
        yield path
    finally:
        remove_region(SHM, warm_engine.engine_id)
        warm_engine.index.unlink(missing_ok=True)


@pytest.fixture
def sha256_hashing() -> Iterator[None]:
    """vLLM's NONE_HASH as an engine seeds it by default (sha256, no PYTHONHASHSEED)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    yield
    init_none_hash(sha256)


def workload(seed: int = 34) -> list[list[int]]:
    """36 prompts of 160 tokens (5 chunks of 32): 6 shared prefixes of 64 tokens, each with 6
    suffixes of 96, interleaved; 120 distinct chunks, over twice the CPU tier's 48."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(64)] for _ in range(6)]
    return [p + [rng.randrange(1000) for _ in range(96)] for _ in range(6) for p in prefixes]


def chunk_keys(request: Any) -> list[tuple[bytes, list[bytes]]]:
    """(OffloadKey, the hashes of its blocks) of each whole chunk of a request, as vLLM's
    offloading scheduler keys them (the last block hash of each chunk, group 0)."""
    from vllm.v1.kv_offload.base import make_offload_key

    hashes = [bytes(h) for h in request.block_hashes]
    return [
        (
            make_offload_key(hashes[i + BLOCKS_PER_CHUNK - 1], 0),
            hashes[i : i + BLOCKS_PER_CHUNK],
        )
        for i in range(0, len(hashes) - BLOCKS_PER_CHUNK + 1, BLOCKS_PER_CHUNK)
    ]


def resident(manager: Any) -> list[bytes]:
    """The committed chunks of a manager, in the order its policy evicts them."""
    policy = manager._journaled
    chunks = policy.chunks if hasattr(policy, "chunks") else {**policy.t1, **policy.t2}
    ready = [key for key, chunk in chunks.items() if chunk.is_ready]
    return sorted(ready, key=policy.order_of)


def lookup_all(manager: Any, keys: list[bytes]) -> int:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    context = ReqContext(req_id="lookup")
    with manager.lock:
        return sum(manager.lookup(key, context) is LookupResult.HIT for key in keys)


# -- hits across a SIGKILL -----------------------------------------------------------------


def run_and_wait_to_be_killed(warm_engine: WarmEngine, snapshot: Path) -> None:
    """Engine A: the workload until the CPU tier is full, then a snapshot of what it holds,
    then nothing until the test SIGKILLs it."""
    torch.set_num_threads(1)  # forked: never use the parent's OpenMP pool
    engine = ModelLessEngine(warm_engine.copy(), kv_cache_config(GPU_BLOCKS))
    blocks: dict[str, list[str]] = {}
    prompts = workload()
    for start in range(0, len(prompts), 4):
        batch = prompts[start : start + 4]
        requests = [engine.add(f"a{start + i}", p) for i, p in enumerate(batch)]
        engine.run()
        for request in requests:
            for key, hashes in chunk_keys(request):
                blocks[key.hex()] = [h.hex() for h in hashes]
    held = resident(engine.manager)
    state = {
        "resident": [key.hex() for key in held],
        "blocks": {key.hex(): blocks[key.hex()] for key in held},
        "wrong_blocks": engine.wrong_blocks,
        "stored": len(blocks),
    }
    snapshot.with_suffix(".tmp").write_text(json.dumps(state))
    snapshot.with_suffix(".tmp").rename(snapshot)
    time.sleep(600)


def test_a_restarted_engine_hits_every_chunk_stored_before_a_sigkill(
    warm_engine: WarmEngine, region: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = tmp_path / "snapshot.json"
    fork_and_kill(
        lambda: run_and_wait_to_be_killed(warm_engine, snapshot),
        tmp_path / "failure",
        when=snapshot.exists,
    )
    before = json.loads(snapshot.read_text())
    held = [bytes.fromhex(k) for k in before["resident"]]
    assert len(held) == CHUNKS, "the workload did not fill the CPU tier"
    assert before["stored"] > 2 * CHUNKS and before["wrong_blocks"] == 0

    engine = ModelLessEngine(warm_engine.copy(), kv_cache_config(GPU_BLOCKS))
    try:
        manager = engine.manager
        hits = lookup_all(manager, held)  # the first call: the index is restored first
        assert manager.warm_outcome.state == "warm", manager.warm_outcome
        assert hits / len(held) >= 0.99, f"{hits} of {len(held)} chunks hit after the restart"
        assert resident(manager) == held, "the restored tier evicts in another order"
        # every restored chunk's bytes, read through vLLM's own region views
        pages = [TINY_PAGE * BLOCKS_PER_CHUNK] * TINY_LAYERS
        with vllm_views(warm_engine.engine_id, CHUNKS, 0, CPU_PAGE, CPU_PAGE, pages) as views:
            for key in held:
                slot = manager._policy.get(key).chunk_id
                for sub, block_hash in enumerate(before["blocks"][key.hex()]):
                    page = block_pattern(bytes.fromhex(block_hash))
                    for view in views:
                        cell = view[slot, sub * TINY_PAGE : (sub + 1) * TINY_PAGE]
                        assert torch.equal(cell, page), f"chunk {slot} holds other bytes"
        # replay the prompts whose chunks the tier holds, most recent first: their chunks load
        # from the CPU tier (a shared prefix from the GPU cache once a replayed prompt has it)
        held_set = set(held)
        replay = [p for p in reversed(workload()) if all(k in held_set for k in _keys_of(p))]
        assert len(replay) >= 6
        suffixes: set[bytes] = set()
        for i, prompt in enumerate(replay):
            request = engine.add(f"b{i}", prompt)
            suffixes.update(key for key, _ in chunk_keys(request)[2:])
            engine.run()
        assert suffixes <= set(engine.loaded_keys), "a held chunk was recomputed"
        assert engine.checked_blocks > 0 and engine.wrong_blocks == 0
        with capsys.disabled():
            print(
                f"\nwarm restart: {hits}/{len(held)} chunks hit; restore "
                f"{manager._report.seconds * 1e3:.1f} ms; engine start to first hit "
                f"{engine.first_hit_seconds:.3f} s; {len(engine.loaded_keys)} chunks loaded"
            )
    finally:
        engine.shutdown()


def _keys_of(prompt: list[int]) -> list[bytes]:
    """The chunk keys vLLM's block hashing gives a prompt (a request that is never run)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    request = Request(
        "keys",
        prompt,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(16, sha256),
    )
    return [key for key, _ in chunk_keys(request)]


# -- the manager on its own ----------------------------------------------------------------


def warm_manager(directory: Path, policy: str = "lru", chunks: int = CHUNKS) -> Any:
    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    warm = WarmStart(str(directory), "unit", {"test": "identity"})
    return KvshmOffloadingManager(chunks, cache_policy=policy, warm=warm)


def unit_key(i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(i.to_bytes(4, "big")).digest(), 0)


def drive(
    manager: Any, rng: random.Random, requests: int, region: Any = None, spread: int = 100
) -> None:
    """Requests as vLLM's offloading scheduler makes them: a run of chunk keys (from `spread`
    starting points: more keys than chunks, so evictions) with their positions, lookups,
    loads of the hits, stores of the rest (completed a step later, or failed now and then),
    finish; a step end after each. `region(slot, key)` writes a stored chunk's bytes."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    pending: list[tuple[list[bytes], ReqContext]] = []
    for r in range(requests):
        context = ReqContext(req_id=f"r{r}-{rng.random()}")
        first = rng.randrange(spread)
        keys = [unit_key(first + i) for i in range(rng.randrange(1, 8))]
        for i, key in enumerate(keys):
            context.set_offload_key_position(key, 32 * (i + 1))
        manager.on_new_request(context)
        hits = 0
        for key in keys:
            if manager.lookup(key, context) is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], context)
            manager.complete_load(keys[:hits], context)
        if rng.random() < 0.3:
            manager.touch(keys[:hits], context)
        out = manager.prepare_store(keys[hits:], context)
        if out is not None and out.keys_to_store:
            if region is not None:
                for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
                    region(int(slot), key)
            pending.append((out.keys_to_store, context))
        while pending and (len(pending) > 2 or rng.random() < 0.5):  # a step or two later
            done, done_context = pending.pop(0)
            manager.complete_store(done, done_context, success=rng.random() > 0.05)
        manager.on_request_finished(context)
        manager.on_schedule_end(None)


def eviction_sequence(manager: Any) -> list[bytes]:
    """The committed chunks in the order the policy evicts them, by evicting them all."""
    policy = manager._policy
    ready = [k for k in resident(manager)]
    evicted = policy.evict(len(ready), set()) or []
    return [key for key, _ in evicted]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_restart_keeps_the_eviction_order(
    shm_dir: Path, sha256_hashing: None, policy: str
) -> None:
    old = warm_manager(shm_dir, policy)
    drive(old, random.Random(7), 400)
    order = resident(old)
    assert len(order) > CHUNKS // 2
    target = getattr(old._policy, "target_t1_size", None)
    old.shutdown()
    new = warm_manager(shm_dir, policy)
    assert lookup_all(new, order) == len(order)
    assert new.warm_outcome.chunks == len(order)
    if policy == "arc":
        assert new._policy.target_t1_size == target
        assert [k for k in new._policy.t1] == [k for k in order if k in old._policy.t1]
    assert eviction_sequence(new) == eviction_sequence(old)
    new.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_restarted_manager_keeps_working_and_restarts_again(
    shm_dir: Path, sha256_hashing: None, policy: str
) -> None:
    """Restored chunks are evicted, reloaded and stored over like any others, and the index
    stays right across a second restart."""
    first = warm_manager(shm_dir, policy)
    drive(first, random.Random(1), 200)
    first.shutdown()
    second = warm_manager(shm_dir, policy)
    drive(second, random.Random(2), 300)
    order = resident(second)
    second.shutdown()
    third = warm_manager(shm_dir, policy)
    assert lookup_all(third, order) == len(order) and resident(third) == order
    assert len(third._free_list) + len(order) == CHUNKS or third._num_allocated_chunks < CHUNKS
    third.shutdown()


class Lockstep:
    """vLLM's own CPUOffloadingManager and a warm KvshmOffloadingManager given the same calls
    (each its own copy of a request's context): every result and counter must be equal."""

    def __init__(self, ours: Any, theirs: Any) -> None:
        self.ours, self.theirs = ours, theirs
        self.contexts: dict[int, tuple[Any, Any]] = {}

    def context_copies(self, context: Any) -> tuple[Any, Any]:
        if id(context) not in self.contexts:
            theirs = copy.copy(context)
            theirs._state = {}  # each manager keeps its own per-request state
            self.contexts[id(context)] = (context, theirs)
        return self.contexts[id(context)]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        from vllm.v1.kv_offload.base import ReqContext

        def both(*args: Any, **kwargs: Any) -> Any:
            copies = [self.context_copies(a) if isinstance(a, ReqContext) else (a, a) for a in args]
            ours = getattr(self.ours, name)(*[a for a, _ in copies], **kwargs)
            theirs = getattr(self.theirs, name)(*[b for _, b in copies], **kwargs)
            assert outcome(ours) == outcome(theirs), name
            assert counters(self.ours) == counters(self.theirs), name
            return ours

        return both


def outcome(result: Any) -> Any:
    if hasattr(result, "keys_to_store"):
        return list(result.keys_to_store), outcome(result.store_spec), list(result.evicted_keys)
    if hasattr(result, "block_ids"):
        return [int(slot) for slot in result.block_ids]
    return result if result is None or isinstance(result, enum.Enum) else type(result)


def counters(manager: Any) -> tuple[Any, ...]:
    return (
        manager._num_evictable_cache_chunks,
        manager._num_write_pending_chunks,
        manager._num_allocated_chunks,
        list(manager._free_list),
    )


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_warm_manager_answers_as_vllms_own(
    shm_dir: Path, sha256_hashing: None, policy: str
) -> None:
    """The manager restates parts of vLLM's (complete_store's success path): same calls, same
    answers, counters and events as vLLM's CPUOffloadingManager."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    warm = WarmStart(str(shm_dir), "unit", {"test": "identity"})
    ours = KvshmOffloadingManager(CHUNKS, cache_policy=policy, enable_events=True, warm=warm)
    theirs = CPUOffloadingManager(CHUNKS, cache_policy=policy, enable_events=True)
    drive(Lockstep(ours, theirs), random.Random(11), 400)
    assert ours.warm_outcome is not None and ours._journal.keeping

    def events(manager: Any) -> list[tuple[Any, ...]]:
        return [(e.keys, e.removed, e.metadata_only) for e in manager.take_events()]

    assert events(ours) == events(theirs)
    ours.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_manager_without_an_index_holds_no_key_past_a_step(shm_dir: Path, policy: str) -> None:
    """With warm restart off (or an index the engine cannot keep) the journaled policy still
    notes every key that moves; a step's end lets them go, or the engine's memory would grow
    with every key it ever served."""
    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    warm = WarmStart(str(shm_dir), "unit", None, off_reason="warm restart off")
    manager = KvshmOffloadingManager(CHUNKS, cache_policy=policy, warm=warm)
    drive(manager, random.Random(5), 300, spread=1000)
    assert manager.warm_outcome is not None and manager.warm_outcome.state == "cold"
    assert len(manager._journal.moved) == 0
    manager.shutdown()


def test_reset_cache_drops_every_chunk_for_a_restart_too(
    shm_dir: Path, sha256_hashing: None
) -> None:
    manager = warm_manager(shm_dir)
    drive(manager, random.Random(3), 100)
    manager.reset_cache()
    manager.shutdown()
    again = warm_manager(shm_dir)
    assert lookup_all(again, [unit_key(i) for i in range(110)]) == 0
    assert again.warm_outcome.state == "warm" and again.warm_outcome.chunks == 0
    again.shutdown()


def test_restored_chunks_are_announced_as_stored_events(
    shm_dir: Path, sha256_hashing: None
) -> None:
    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    manager = warm_manager(shm_dir)
    drive(manager, random.Random(4), 100)
    order = resident(manager)
    manager.shutdown()
    warm = WarmStart(str(shm_dir), "unit", {"test": "identity"})
    again = KvshmOffloadingManager(CHUNKS, enable_events=True, warm=warm)
    lookup_all(again, order[:1])
    (event,) = list(again.take_events())
    assert not event.removed and sorted(event.keys) == sorted(order)
    again.shutdown()


# -- crash safety of the manager -----------------------------------------------------------

ROW = 4096
KILLS = int(os.environ.get("KVSHM_MANAGER_KILLS", "200"))


def row_pattern(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * (ROW // 32))[:ROW]


def crash_child(directory: Path, seed: int) -> None:
    """The manager with its workers in one process: a chunk's bytes are written between
    prepare_store (which invalidated what it evicted) and complete_store, in pieces."""
    import mmap

    fd = os.open(directory / "rows", os.O_RDWR)
    rows = mmap.mmap(fd, CHUNKS * ROW)

    def store(slot: int, key: bytes) -> None:
        data = row_pattern(key)
        for i in range(0, ROW, 1024):
            rows[slot * ROW + i : slot * ROW + i + 1024] = data[i : i + 1024]

    manager = warm_manager(directory)
    rng = random.Random(seed)
    while True:
        drive(manager, rng, 50, store)
        if rng.random() < 0.05:
            manager.reset_cache()


def test_no_chunk_whose_store_did_not_complete_is_restored_after_any_sigkill(
    shm_dir: Path, sha256_hashing: None
) -> None:
    (shm_dir / "rows").write_bytes(bytes(CHUNKS * ROW))
    rng = random.Random(34)
    restored = []
    for round_ in range(KILLS):

        def child(seed: int = round_) -> None:
            torch.set_num_threads(1)  # forked: never use the parent's OpenMP pool
            crash_child(shm_dir, seed)

        fork_and_kill(child, shm_dir / "failure", after=rng.uniform(0.002, 0.05))
        rows = (shm_dir / "rows").read_bytes()
        manager = warm_manager(shm_dir)
        held = [unit_key(i) for i in range(110)]
        lookup_all(manager, held)
        for key in resident(manager):
            slot = manager._policy.get(key).chunk_id
            assert rows[slot * ROW : (slot + 1) * ROW] == row_pattern(key), (
                f"after kill {round_}: chunk {slot} is restored but its store did not complete"
            )
        restored.append(len(resident(manager)))
        manager.shutdown()
    assert sum(1 for n in restored if n) > KILLS // 2


# -- identity ------------------------------------------------------------------------------


def scheduler_manager(config: Any, kv_config: Any | None = None) -> Any:
    """The manager vLLM's OffloadingConnector builds on the scheduler's side."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    kv_config = kv_config if kv_config is not None else kv_cache_config(GPU_BLOCKS)
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    return connector.connector_scheduler.manager


def store_some(manager: Any, count: int = 12) -> list[bytes]:
    from vllm.v1.kv_offload.base import ReqContext

    keys = [unit_key(1000 + i) for i in range(count)]
    context = ReqContext(req_id="store")
    manager.on_new_request(context)
    out = manager.prepare_store(keys, context)
    manager.complete_store(out.keys_to_store, context)
    manager.on_schedule_end(None)
    return keys


def with_sub(config: Any, name: str, **changes: Any) -> Any:
    sub = copy.copy(getattr(config, name))
    for field, value in changes.items():
        setattr(sub, field, value)
    setattr(config, name, sub)
    return config


def extra(config: Any, **changes: Any) -> Any:
    transfer = copy.copy(config.kv_transfer_config)
    transfer.kv_connector_extra_config = {**transfer.kv_connector_extra_config, **changes}
    config.kv_transfer_config = transfer
    return config


def hashing(name: str, seed: str | None) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash

        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        init_none_hash(get_hash_fn_by_name(name))

    return apply


def other_hf_config(config: Any) -> Any:
    hf_config = copy.deepcopy(config.model_config.hf_config)
    hf_config.rope_theta = 123456.0
    return with_sub(config, "model_config", hf_config=hf_config)


def renamed_layers() -> Any:
    kv_config = kv_cache_config(GPU_BLOCKS)
    (group,) = kv_config.kv_cache_groups
    group.layer_names = [f"model.decoder.{i}.attn" for i in range(TINY_LAYERS)]
    for tensor, name in zip(kv_config.kv_cache_tensors, group.layer_names, strict=True):
        tensor.layers = [name]
    return kv_config


def unchanged(config: Any) -> Any:
    return config


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One restart of another identity: the field the log and the metric must name, how the
    engine's config differs, its KV cache config if that differs, and what else does (the
    process's hashing, the weights' file, the region's file, vLLM's version)."""

    field: str
    config: Callable[[Any], Any] = unchanged
    kv: Callable[[], Any] | None = None
    besides: Any = None


MISMATCHES = [
    Mismatch("model.config", other_hf_config),
    Mismatch("model.revision", lambda c: with_sub(c, "model_config", revision="v2")),
    Mismatch("model.quantization", lambda c: with_sub(c, "model_config", quantization="fp8")),
    Mismatch("model.weights", besides="weights"),
    Mismatch("dtype.model", lambda c: with_sub(c, "model_config", dtype=torch.float16)),
    Mismatch("dtype.kv_cache", lambda c: with_sub(c, "cache_config", cache_dtype="fp8")),
    Mismatch("kv.layout", lambda c: with_sub(c, "cache_config", kv_cache_layout="BLHNC")),
    Mismatch("kv.groups", kv=renamed_layers),
    Mismatch(
        "block.blocks_per_chunk",
        lambda c: extra(c, blocks_per_chunk=1, cpu_bytes_to_use=CHUNKS * CPU_PAGE // 2),
    ),
    Mismatch(
        "parallel.tp",
        lambda c: with_sub(c, "parallel_config", tensor_parallel_size=2, world_size=2),
    ),
    Mismatch("parallel.dp_index", lambda c: with_sub(c, "parallel_config", data_parallel_index=1)),
    Mismatch("hash.none_hash", besides=hashing("sha256", "1234")),
    Mismatch(
        "hash.algorithm",
        lambda c: with_sub(c, "cache_config", prefix_caching_hash_algo="sha256_cbor"),
        besides=hashing("sha256_cbor", None),
    ),
    Mismatch("vllm.version", besides="vllm.version"),
    Mismatch("region.file", besides="region"),
    Mismatch("cache.policy", lambda c: extra(c, eviction_policy="arc")),
]


@pytest.mark.parametrize("case", MISMATCHES, ids=[case.field for case in MISMATCHES])
def test_a_mismatched_identity_never_hits(
    warm_engine: WarmEngine,
    region: str,
    sha256_hashing: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: Mismatch,
) -> None:
    field, besides = case.field, case.besides
    old = scheduler_manager(warm_engine.copy())
    keys = store_some(old)
    assert old.warm_outcome.reason == "a new index: no engine wrote it yet"
    old.shutdown()
    if besides == "vllm.version":
        import vllm

        monkeypatch.setattr(vllm, "__version__", "0.33.99")
    elif besides == "weights":
        weights = warm_engine.model_dir / WEIGHTS
        saved = weights.read_bytes()
        weights.write_bytes(b"fine-tuned weights")
    elif besides == "region":
        remove_region(SHM, warm_engine.engine_id)  # the agent made the region again
        agent_region(SHM, warm_engine.engine_id, CHUNKS, CPU_PAGE, 1)
    elif besides is not None:
        besides(monkeypatch)
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvshm.vllm.warm.manager"):
            new = scheduler_manager(case.config(warm_engine.copy()), case.kv() if case.kv else None)
            assert lookup_all(new, keys) == 0
        assert new.warm_outcome.state == "cold" and new.warm_outcome.chunks == 0
        assert len(resident(new)) == 0
        (line,) = [r.getMessage() for r in caplog.records if "warm restart" in r.getMessage()]
        assert f"{field} (index: " in line, line
        stats = new.get_stats()
        dropped = stats.data["data"]["kvshm_warm_index_dropped"]
        assert (field,) in dropped, dropped
        new.shutdown()
    finally:
        if besides == "weights":
            (warm_engine.model_dir / WEIGHTS).write_bytes(saved)


def test_at_least_ten_identity_fields_are_checked() -> None:
    assert len({case.field for case in MISMATCHES}) >= 10


def test_random_hash_seeds_keep_no_index(
    warm_engine: WarmEngine, region: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xxhash without PYTHONHASHSEED: vLLM seeds each process randomly, so no restarted engine
    can find a block again: the plugin writes no record and says why."""
    old = scheduler_manager(warm_engine.copy())
    hashing("sha256", None)(monkeypatch)
    store_some(old)
    old.shutdown()
    hashing("xxhash", None)(monkeypatch)
    config = with_sub(warm_engine.copy(), "cache_config", prefix_caching_hash_algo="xxhash")
    manager = scheduler_manager(config)
    keys = store_some(manager)
    assert "seeded randomly per process" in manager.warm_outcome.reason
    assert not manager._journal.keeping
    manager.shutdown()
    again = scheduler_manager(config)
    assert lookup_all(again, keys) == 0
    again.shutdown()
    hashing("sha256", None)(monkeypatch)


def test_warm_restart_off_invalidates_the_index(
    warm_engine: WarmEngine, region: str, sha256_hashing: None
) -> None:
    old = scheduler_manager(warm_engine.copy())
    keys = store_some(old)
    old.shutdown()
    off = scheduler_manager(extra(warm_engine.copy(), kvshm_warm_restart=False))
    assert lookup_all(off, keys) == 0
    assert off.warm_outcome.reason == "kvshm_warm_restart is false"
    store_some(off)  # overwrites chunks the index named: they must not come back
    off.shutdown()
    on = scheduler_manager(warm_engine.copy())
    assert lookup_all(on, keys) == 0
    on.shutdown()


def test_the_index_is_warm_across_an_unchanged_restart(
    warm_engine: WarmEngine, region: str, sha256_hashing: None
) -> None:
    old = scheduler_manager(warm_engine.copy())
    keys = store_some(old)
    old.shutdown()
    new = scheduler_manager(warm_engine.copy())
    assert lookup_all(new, keys) == len(keys)
    stats = new.get_stats().data["data"]
    assert stats["kvshm_warm_index_restored_chunks"] == {(): float(len(keys))}
    assert stats["kvshm_warm_index_restore_seconds"][()] > 0
    new.shutdown()
    assert warm_engine.index.stat().st_mode & 0o777 == 0o600


def test_the_spec_declares_the_metrics_for_vllms_metrics_endpoint() -> None:
    from kvshm.vllm.spec import KvshmOffloadingSpec

    names = KvshmOffloadingSpec.build_metric_definitions({})
    assert {
        "kvshm_warm_index_restored_chunks",
        "kvshm_warm_index_restore_seconds",
        "kvshm_warm_index_dropped",
    } <= set(names)
    assert names["kvshm_warm_index_dropped"].labelnames == ("reason",)


def other_tenant(warm_engine: WarmEngine) -> WarmEngine:
    """A second engine of the same model on a region of its own (another tenant's)."""
    engine_id = f"{warm_engine.engine_id}-other"
    flags = copy.deepcopy(warm_engine.config.kv_transfer_config)
    flags.engine_id = engine_id
    config = warm_engine.copy()
    config.kv_transfer_config = flags
    return WarmEngine(warm_engine.model_dir, engine_id, config)


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "garbage header": lambda data: os.urandom(4096) + data[4096:],
    "garbage records": lambda data: data[:4096] + os.urandom(len(data) - 4096),
    "truncated": lambda data: data[:100],
    "oversized": lambda data: data + os.urandom(1 << 20),
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_tenants_damaged_index_harms_only_its_own_engine(
    warm_engine: WarmEngine, region: str, sha256_hashing: None, damage: str
) -> None:
    """A tenant who writes over its own index: its next engine starts cold (never crashes,
    never hits a key a damaged record named; bytes past the file's size are cut off), works,
    and is warm again at the restart after; another tenant's engine, on its own region and
    index, stays warm throughout."""
    other = other_tenant(warm_engine)
    other.index.unlink(missing_ok=True)
    agent_region(SHM, other.engine_id, CHUNKS, CPU_PAGE, 1)
    try:
        theirs = scheduler_manager(other.copy())
        their_keys = store_some(theirs)
        theirs.shutdown()
        old = scheduler_manager(warm_engine.copy())
        keys = store_some(old)
        old.shutdown()
        index = warm_engine.index
        index.write_bytes(DAMAGES[damage](index.read_bytes()))
        damaged = scheduler_manager(warm_engine.copy())
        hits = lookup_all(damaged, keys)
        assert damaged.warm_outcome is not None
        if damage == "oversized":  # cut back to its size: the records it held are intact
            assert hits == len(keys) and damaged.warm_outcome.state == "warm"
        elif damage == "garbage records":  # a valid header: every record fails its checks
            assert hits == 0 and damaged.warm_outcome.chunks == 0
        else:
            assert hits == 0 and damaged.warm_outcome.state == "cold"
        stored = store_some(damaged, count=6)
        assert lookup_all(damaged, stored) == len(stored)
        damaged.shutdown()
        again = scheduler_manager(warm_engine.copy())
        assert lookup_all(again, stored) == len(stored)  # its own index works again
        again.shutdown()
        theirs = scheduler_manager(other.copy())
        assert theirs.warm_outcome is None or theirs.warm_outcome.state == "warm"
        assert lookup_all(theirs, their_keys) == len(their_keys)
        assert theirs.warm_outcome is not None and theirs.warm_outcome.state == "warm"
        theirs.shutdown()
    finally:
        remove_region(SHM, other.engine_id)
        other.index.unlink(missing_ok=True)


# -- an index the engine cannot use --------------------------------------------------------


@contextlib.contextmanager
def index_locked(index: Path) -> Iterator[None]:
    """Another open file description holds the index's writer lock (the scheduler of an engine
    still shutting down, or any process of the tenant's)."""
    fd = os.open(index, os.O_RDWR)
    try:
        assert try_lock_byte(fd, 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def index_hard_linked(index: Path) -> Iterator[None]:
    """A second name for the index (a backup made with hard links: cp -al, rsync
    --link-dest), gone again after the engine."""
    backup = index.with_name(index.name + ".backup")
    os.link(index, backup)
    try:
        yield
    finally:
        backup.unlink()


@contextlib.contextmanager
def index_immutable(index: Path) -> Iterator[None]:
    """The index can be neither opened for writing nor removed, by root either (chattr +i)."""
    subprocess.run(["chattr", "+i", str(index)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(index)], check=True)


UNUSABLE: dict[str, Callable[[Path], contextlib.AbstractContextManager[None]]] = {
    "locked": index_locked,
    "hard-linked": index_hard_linked,
    "immutable": index_immutable,
}
NOT_REMOVABLE = {"immutable"}  # the index cannot be removed either


def run_prompts(engine: ModelLessEngine, prompts: list[list[int]], prefix: str) -> None:
    for start in range(0, len(prompts), 4):
        for i, prompt in enumerate(prompts[start : start + 4]):
            engine.add(f"{prefix}{start + i}", prompt)
        engine.run()


@pytest.mark.parametrize("cause", list(UNUSABLE))
def test_an_engine_without_the_index_never_leaves_it_naming_rows_it_stored_over(
    warm_engine: WarmEngine, region: str, cause: str
) -> None:
    """Engine A fills the tier and leaves an index; engine B cannot use the index (`cause`)
    and serves other prompts; engine C, the index usable again, replays A's prompts. If B
    stored over A's rows while A's records stayed valid, C would load another prompt's KV
    into A's: B must remove the index before its first store, or store nothing."""
    a = ModelLessEngine(warm_engine.copy(), kv_cache_config(GPU_BLOCKS))
    try:
        run_prompts(a, workload(), "a")
        held = resident(a.manager)
    finally:
        a.shutdown()
    assert len(held) == CHUNKS
    with UNUSABLE[cause](warm_engine.index):
        b = ModelLessEngine(warm_engine.copy(), kv_cache_config(GPU_BLOCKS))
        try:
            run_prompts(b, workload(seed=35), "b")
            stored_by_b = resident(b.manager)
            b_outcome = b.manager.warm_outcome
        finally:
            b.shutdown()
    assert b_outcome.state == "cold" and "cannot be used" in b_outcome.reason, b_outcome
    c = ModelLessEngine(warm_engine.copy(), kv_cache_config(GPU_BLOCKS))
    try:
        held_set = set(held)
        replay = [p for p in reversed(workload()) if all(k in held_set for k in _keys_of(p))]
        run_prompts(c, replay, "c")
        assert c.wrong_blocks == 0, f"{c.wrong_blocks} blocks loaded with another prompt's KV"
        if cause in NOT_REMOVABLE:
            assert stored_by_b == [] and "stores nothing" in b_outcome.reason, b_outcome
            assert c.manager.warm_outcome.chunks == CHUNKS  # A's chunks, intact
            assert c.loaded_keys and c.checked_blocks > 0
        else:
            assert len(stored_by_b) == CHUNKS and "removed" in b_outcome.reason, b_outcome
            assert c.manager.warm_outcome.state == "cold"  # a new index: nothing restored
            assert not c.loaded_keys
    finally:
        c.shutdown()


def index_short_on_a_full_tmpfs(index: Path) -> contextlib.AbstractContextManager[None]:
    """The index cut short (its first page of records kept) on a tmpfs then filled: opening it
    must size it again, and no page is left to give it."""
    os.truncate(index, 2 * 4096)
    return filled(index.parent)


@contextlib.contextmanager
def filled(directory: Path) -> Iterator[None]:
    filler = directory / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], check=False, capture_output=True
    )
    try:
        yield
    finally:
        filler.unlink()


@contextlib.contextmanager
def index_of_another_uid(index: Path) -> Iterator[None]:
    """The engine runs as the tenant's uid, owner of its directory; the index is root's, mode
    0600 (an earlier engine of the region ran as root)."""
    os.chown(index.parent, TENANT_UID, TENANT_UID)
    yield


UNUSABLE_BY_MANAGER: dict[str, Callable[[Path], contextlib.AbstractContextManager[None]]] = {
    **UNUSABLE,
    "short on a full tmpfs": index_short_on_a_full_tmpfs,
    "of another uid": index_of_another_uid,
}
MANY_CHUNKS = 200  # records over several pages of the index


def store_rows(manager: Any, keys: list[bytes], rows: Path) -> list[bytes]:
    """Store keys as vLLM's scheduler and a worker do: prepare, the rows written, complete.
    The keys actually stored."""
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id="rows")
    manager.on_new_request(context)
    out = manager.prepare_store(keys, context)
    with open(rows, "r+b") as f:
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            f.seek(int(slot) * ROW)
            f.write(row_pattern(key))
    manager.complete_store(out.keys_to_store, context)
    manager.on_request_finished(context)
    manager.on_schedule_end(None)
    return list(out.keys_to_store)


def as_uid(uid: int, run: Callable[[], Any]) -> Any:
    """run() in a forked process of `uid`; what it returns, as JSON."""
    ours, theirs = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ours)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(theirs, json.dumps(run()).encode())
            code = 0
        except BaseException:
            os.write(theirs, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(theirs)
    with os.fdopen(ours, "rb") as replies:
        reply = replies.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, reply.decode()
    return json.loads(reply)


@pytest.mark.parametrize("warm_restart", ["on", "off"])
@pytest.mark.parametrize("cause", list(UNUSABLE_BY_MANAGER))
def test_an_index_the_manager_cannot_use_is_removed_or_nothing_is_stored(
    shm_dir: Path,
    sha256_hashing: None,
    request: pytest.FixtureRequest,
    cause: str,
    warm_restart: str,
) -> None:
    """Every way the index can be unusable, with warm restart on (the index is not adopted)
    or off (its records are not invalidated): the engine's stores never leave a record valid
    over a row they wrote."""
    from kvshm.vllm.warm.manager import STORES_OFF, KvshmOffloadingManager, WarmStart

    directory = request.getfixturevalue("small_tmpfs") if "full" in cause else shm_dir
    rows = shm_dir / "rows"
    rows.write_bytes(bytes(MANY_CHUNKS * ROW))
    first = warm_manager(directory, chunks=MANY_CHUNKS)
    held = store_rows(first, [unit_key(i) for i in range(4)], rows)
    first.shutdown()
    index = directory / index_file_name("unit")

    def unusable_engine() -> dict[str, Any]:
        identity = {"test": "identity"} if warm_restart == "on" else None
        warm = WarmStart(str(directory), "unit", identity, off_reason="warm restart is off")
        manager = KvshmOffloadingManager(MANY_CHUNKS, warm=warm)
        stored = store_rows(manager, [unit_key(100 + i) for i in range(4)], rows)
        stats = manager.get_stats().data["data"]
        manager.shutdown()
        outcome = manager.warm_outcome
        return {
            "stored": len(stored),
            "state": outcome.state,
            "reason": outcome.reason,
            "stores_off": stats[STORES_OFF][()],
        }

    with UNUSABLE_BY_MANAGER[cause](index):
        if cause == "of another uid":
            rows.chmod(0o666)
            second = as_uid(TENANT_UID, unusable_engine)
        else:
            second = unusable_engine()
    third = warm_manager(directory, chunks=MANY_CHUNKS)
    lookup_all(third, held)
    restored = resident(third)
    data = rows.read_bytes()
    for key in restored:
        slot = third._policy.get(key).chunk_id
        assert data[slot * ROW : (slot + 1) * ROW] == row_pattern(key), (
            f"chunk {slot} is restored for a key whose row the unusable engine stored over"
        )
    third.shutdown()
    assert second["state"] == "cold", second
    unusable = "cannot be used" if warm_restart == "on" else "cannot be invalidated"
    assert unusable in second["reason"], second
    if cause in NOT_REMOVABLE:
        assert second["stored"] == 0 and second["stores_off"] == 1.0, second
        assert "stores nothing" in second["reason"], second
        assert sorted(restored) == sorted(held)  # the first engine's chunks, intact
    else:
        assert second["stored"] == 4 and second["stores_off"] == 0.0, second
        assert "it was removed" in second["reason"], second
        assert restored == []
