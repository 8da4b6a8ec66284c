"""kvshm's JournaledLRU evicts as vLLM 0.33's own LRUCachePolicy does, entry for entry: the same
random operations (inserts, touches, pins and unpins, removals, evictions with protected keys,
evictions that must fail whole) give the same answers and leave the same state, and every
chunk it evicts is handed to the journal (whose record then names no slot a store may reuse)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from kvshm.vllm.warm.journal import IndexJournal
from kvshm.vllm.warm.policies import JournaledLRU

KEYS = [f"key-{i}".encode() for i in range(48)]


class RecordingJournal(IndexJournal):
    __slots__ = ("evicted_chunks",)

    def __init__(self) -> None:
        super().__init__()
        self.evicted_chunks: list[int] = []

    def evicted(self, evicted: Any) -> None:
        self.evicted_chunks.extend(chunk.chunk_id for _, chunk in evicted or ())


def state(policy: LRUCachePolicy) -> tuple[Any, ...]:
    return (
        {key: (chunk.ref_cnt, chunk.chunk_id) for key, chunk in policy.chunks.items()},
        dict(policy._ranks),
        set(policy._evictable),
        sorted(entry for entry in policy._heap if policy._is_current(entry)),
    )


def answer(evicted: list[tuple[bytes, ChunkStatus]] | None) -> Any:
    return None if evicted is None else [(key, chunk.chunk_id) for key, chunk in evicted]


@pytest.mark.parametrize("seed", range(8))
def test_evict_gives_vllms_answers_and_journals_every_evicted_chunk(seed: int) -> None:
    rng = random.Random(seed)
    journal = RecordingJournal()
    ours, theirs = JournaledLRU(32, journal), LRUCachePolicy(32)
    evictions = failures = 0
    for step in range(3000):
        context = ReqContext(req_id=f"r{step % 7}")
        key = rng.choice(KEYS)
        op = rng.random()
        if op < 0.3 and key not in theirs.chunks:
            ready = rng.random() < 0.7
            for policy in (ours, theirs):
                chunk = ChunkStatus(KEYS.index(key))
                chunk.ref_cnt = 0 if ready else -1
                policy.insert(key, chunk, context)
        elif op < 0.45:
            keys = rng.sample(KEYS, rng.randrange(1, 6))
            for policy in (ours, theirs):
                policy.touch(keys, context)
        elif op < 0.55 and key in theirs._evictable:  # a load pins it
            for policy in (ours, theirs):
                policy.chunks[key].ref_cnt = 1
                policy.mark_non_evictable(key)
        elif op < 0.65 and key in theirs.chunks and theirs.chunks[key].ref_cnt != 0:
            for policy in (ours, theirs):  # a store or load completes
                policy.chunks[key].ref_cnt = 0
                policy.mark_evictable(key)
        elif op < 0.7 and key in theirs.chunks:
            for policy in (ours, theirs):
                policy.remove(key)
        else:
            n = rng.randrange(0, 6)
            protected = set(rng.sample(KEYS, rng.randrange(0, 12)))
            before = len(journal.evicted_chunks)
            mine, vllms = ours.evict(n, protected), theirs.evict(n, protected)
            assert answer(mine) == answer(vllms), f"step {step}: evict({n}, {protected})"
            journaled = journal.evicted_chunks[before:]
            assert journaled == [chunk.chunk_id for _, chunk in mine or ()]
            evictions += bool(mine)
            failures += mine is None
        assert state(ours) == state(theirs), f"step {step}"
    assert evictions > 50 and failures > 10  # both outcomes were exercised
