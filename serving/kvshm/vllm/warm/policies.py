"""vLLM 0.33's LRU and ARC cache policies, journaled for the warm-restart index: each notes
which keys moved in the eviction order (written to the index at a step's end) and hands its
evicted chunks to the index's journal at once, so their records are invalid before a store can
target their slots; each can give a committed chunk's eviction order, and restore committed
chunks into a fresh policy in that order (docs/warm-restart.md, "Eviction order"). The journal
(kvshm.vllm.warm.journal) owns the index; the manager (kvshm.vllm.warm.manager) decides when it
is written.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from kvshm.region.index.writer import IndexRecord
from kvshm.vllm.warm.journal import Commit, IndexJournal
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

RESTORE_REQUEST = "kvshm-warm-restart"  # the request id restored chunks are inserted under
ARC_T1, ARC_T2 = 1, 2  # which of ARC's lists a committed chunk was in, the order's first field


def _listed(keys: Iterable[OffloadKey]) -> Collection[OffloadKey]:
    """Keys that can be walked twice (vLLM's manager passes lists; a generator is copied)."""
    return keys if isinstance(keys, (list, tuple, set, frozenset)) else list(keys)


class JournaledLRU(LRUCachePolicy):
    """vLLM 0.33's LRU; a key's order is its rank tuple (a request's rank, minus its position),
    which vLLM evicts smallest first. A rank changes at insert, at a request's access and
    finish, and at touch; the index gets it at the commit and after each touch and finish (a
    request still running when the engine dies leaves its keys in the order of their last
    finished use)."""

    _next_rank: int  # vLLM's LRU state that restore() sets (vLLM's types are Any here)
    _heap: list[Any]

    def __init__(self, cache_capacity: int, journal: IndexJournal) -> None:
        super().__init__(cache_capacity)
        self.journal = journal

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = _listed(keys)
        super().touch(keys, req_context)
        self.journal.moved.update(keys)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM's LRU takes a store miss as a touch (CachePolicy's default); its keys are not
        # resident, so the touch moves none of them and there is nothing to journal
        LRUCachePolicy.touch(self, keys, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        moved = self.journal.moved
        for keys in key_groups:
            moved.update(keys)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """The n least recently used evictable chunks outside `protected`, removed, or None
        (and nothing removed) where there are fewer: vLLM's LRU contract, its per-entry
        check done here rather than by a method call an entry; and each evicted chunk's
        record invalidated before the chunks are handed back for reuse."""
        if n == 0:
            return []
        heap, ranks, evictable, chunks = self._heap, self._ranks, self._evictable, self.chunks
        oldest: dict[OffloadKey, Any] = {}  # key -> its heap entry, least recent first
        kept_back: list[Any] = []  # protected: back on the heap whatever happens
        while heap and len(oldest) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            # lazy deletion: an entry counts only while it holds its key's current rank (a
            # re-pin can leave an equal second one, which lands on the same key in `oldest`)
            if key not in evictable or ranks.get(key) != rank:
                continue
            if key in protected:
                kept_back.append(entry)
            elif chunks[key].ref_cnt != 0:  # evictable means unused: a broken invariant
                raise AssertionError(f"chunk {chunks[key].chunk_id} is evictable but in use")
            else:
                oldest[key] = entry
        for entry in kept_back:
            heapq.heappush(heap, entry)
        if len(oldest) < n:
            for entry in oldest.values():
                heapq.heappush(heap, entry)
            return None
        evicted = []
        for key in oldest:
            chunk = chunks.pop(key)
            evictable.remove(key)
            del ranks[key]
            evicted.append((key, chunk))
        self.journal.evicted(evicted)
        self._maybe_compact_heap()
        return evicted

    def order_of(self, key: OffloadKey) -> tuple[int, int]:
        rank: tuple[int, int] = self._ranks[key]
        return rank

    def mark_stored(self, keys: Iterable[OffloadKey]) -> list[Commit]:
        """What vLLM's complete_store does to each key whose store completed (a resident chunk
        not ready yet: ready now, and mark_evictable: evictable, on the heap with its rank), in
        one pass; the (slot, key, order) of each, to commit."""
        get, ranks, evictable, heap = self.chunks.get, self._ranks, self._evictable, self._heap
        push, stored = heapq.heappush, []
        for key in keys:
            chunk = get(key)
            if chunk is not None and chunk.ref_cnt < 0:  # vLLM's `not chunk.is_ready`
                chunk.ref_cnt = 0
                rank = ranks[key]
                evictable.add(key)
                push(heap, (rank, key))
                stored.append((chunk.chunk_id, key, rank))
        if stored:  # once, not a key: compacted later, the heap's current entries are the same
            self._maybe_compact_heap()
        return stored

    def committed_orders(self, keys: Iterable[OffloadKey]) -> list[tuple[int, tuple[int, int]]]:
        """(slot, order) of each key that is resident and committed (ready)."""
        get, ranks = self.chunks.get, self._ranks
        return [
            (chunk.chunk_id, ranks[key])
            for key in keys
            if (chunk := get(key)) is not None and chunk.ref_cnt >= 0
        ]

    def restore(self, records: Sequence[IndexRecord], target_t1: float) -> None:
        """Committed chunks, ready and evictable, with the ranks they had: vLLM's own LRU state
        (its chunks, ranks, evictable set and heap) as the old engine left it, and later
        requests ranked after every one of them."""
        del target_t1
        chunks, ranks, evictable = self.chunks, self._ranks, self._evictable
        for record in records:
            key = OffloadKey(record.key)
            chunk = ChunkStatus(record.slot)
            chunk.ref_cnt = 0
            chunks[key] = chunk
            ranks[key] = record.order
            evictable.add(key)
        self._heap = [(ranks[key], key) for key in evictable]
        heapq.heapify(self._heap)
        if records:  # sorted by order: the last has the largest rank
            self._next_rank = max(self._next_rank, records[-1].order[0])


class JournaledARC(ARCCachePolicy):
    """vLLM 0.33's ARC, stamping a key each time it moves to the end of T1 or T2 (ARC changes a
    list only by appending at its end and by removing), so a key's order is its list and
    stamp, and each list sorted by stamp is the list."""

    def __init__(self, cache_capacity: int, journal: IndexJournal) -> None:
        super().__init__(cache_capacity)
        self.journal = journal
        self.stamps: dict[OffloadKey, int] = {}
        self._stamp = 0

    def _moved(self, key: OffloadKey) -> None:
        self._stamp += 1
        self.stamps[key] = self._stamp
        self.journal.moved.add(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        super().insert(key, chunk, req_context)
        self._stamp += 1  # its commit writes the order: nothing to journal before
        self.stamps[key] = self._stamp

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = _listed(keys)
        super().touch(keys, req_context)
        t1, t2 = self.t1, self.t2
        for key in reversed(list(keys)):  # ARC's own order: each key it finds goes to an end
            if key in t1 or key in t2:
                self._moved(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        t1, t2 = self.t1, self.t2
        for key in reversed(order_request_keys(key_groups, req_context)):
            if (key in insertion_only_keys or key in reused_keys) and (key in t1 or key in t2):
                self._moved(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        evicted = super().evict(n, protected)
        self.journal.evicted(evicted)
        if evicted:
            for key, _ in evicted:
                self.stamps.pop(key, None)
        return evicted

    def remove(self, key: OffloadKey) -> None:
        super().remove(key)
        self.stamps.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self.stamps.clear()

    def order_of(self, key: OffloadKey) -> tuple[int, int]:
        return (ARC_T1 if key in self.t1 else ARC_T2, self.stamps[key])

    def mark_stored(self, keys: Iterable[OffloadKey]) -> list[Commit]:
        """What vLLM's complete_store does to each key whose store completed (a resident chunk
        not ready yet: ready now, and mark_evictable); the (slot, key, order) of each, to
        commit."""
        stored = []
        for key in keys:
            chunk = self.get(key)
            if chunk is not None and chunk.ref_cnt < 0:  # vLLM's `not chunk.is_ready`
                chunk.ref_cnt = 0
                self.mark_evictable(key)
                stored.append((chunk.chunk_id, key, self.order_of(key)))
        return stored

    def committed_orders(self, keys: Iterable[OffloadKey]) -> Iterator[tuple[int, tuple[int, int]]]:
        """(slot, order) of each key that is resident and committed (ready)."""
        t1, t2, stamps = self.t1, self.t2, self.stamps
        for key in keys:
            chunk, listed = t1.get(key), ARC_T1
            if chunk is None:
                chunk, listed = t2.get(key), ARC_T2
            if chunk is not None and chunk.ref_cnt >= 0:
                yield chunk.chunk_id, (listed, stamps[key])

    def restore(self, records: Sequence[IndexRecord], target_t1: float) -> None:
        """T1's chunks in order, then T2's (vLLM's ARC puts a ready chunk it touches in T1 at
        T2's end), with their stamps, and ARC's adaptive target."""
        context = ReqContext(req_id=RESTORE_REQUEST)
        for record in records:
            key = OffloadKey(record.key)
            chunk = ChunkStatus(record.slot)
            chunk.ref_cnt = 0
            ARCCachePolicy.insert(self, key, chunk, context)
            if record.order[0] == ARC_T2:
                ARCCachePolicy.touch(self, [key], context)
            self.stamps[key] = record.order[1]
        if records:
            self._stamp = max(self._stamp, max(r.order[1] for r in records))
        if target_t1 == target_t1:  # not NaN: a tenant's header holds any float
            self.target_t1_size = min(max(target_t1, 0.0), float(self.cache_capacity))


JournaledPolicy = JournaledLRU | JournaledARC
