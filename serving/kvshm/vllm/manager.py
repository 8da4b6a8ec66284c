"""KvshmOffloadingManager: vLLM 0.33's CPUOffloadingManager (its LRU or ARC policy,
store_threshold, events and stats), keeping the warm-restart index of its region, so a
restarted engine of the same identity starts with every chunk whose store completed, in the
same eviction order (docs/warm-restart.md).

The index is written where vLLM's contract says a chunk changed: complete_store commits (all
workers reported the store), the policy's evict invalidates inside prepare_store (before the
new store's job reaches a worker), reset_cache moves to a new generation, and each step's end
writes the eviction order of the keys that moved. The manager restores at its first call: vLLM
seeds its block hashing (init_none_hash) only after it has built the scheduler.
"""

from __future__ import annotations

import functools
import gc
import heapq
import logging
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshm.region.index import (
    Adoption,
    IndexRecord,
    IndexUnavailable,
    Outcome,
    RegionIndex,
    now,
)
from kvshm.region.naming import index_file_name
from kvshm.vllm.identity import HashingNotReady, hash_identity
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

log = logging.getLogger(__name__)

RESTORED_CHUNKS = "kvshm_warm_index_restored_chunks"
RESTORE_SECONDS = "kvshm_warm_index_restore_seconds"
DROPPED = "kvshm_warm_index_dropped"
# what a drop is counted by: an identity field's name, or one of these
DROP_NEW, DROP_DAMAGED, DROP_UNAVAILABLE, DROP_OFF = "new", "damaged", "unavailable", "off"

# the manager's calls that can come first: the index is restored before any of them runs
_FIRST_CALLS = ("on_new_request", "lookup", "prepare_store", "touch", "on_schedule_end")
_RESTORE_REQUEST = "kvshm-warm-restart"
_ARC_T1, _ARC_T2 = 1, 2

Commit = tuple[int, OffloadKey, tuple[int, int]]  # a chunk's slot, key and eviction order


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The manager's metrics, declared by the spec for vLLM's /metrics (docs/metrics.md)."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    return {
        RESTORED_CHUNKS: OffloadingGaugeMetadata(
            documentation="Chunks this engine's CPU tier started with from the region's "
            "warm-restart index (0: it started cold)."
        ),
        RESTORE_SECONDS: OffloadingGaugeMetadata(
            documentation="Seconds the manager took at its first call to check and restore "
            "the warm-restart index."
        ),
        DROPPED: OffloadingCounterMetadata(
            documentation="Warm-restart indexes this engine did not use, by reason: the "
            "identity field that differed, new, damaged, unavailable or off.",
            labelnames=("reason",),
        ),
    }


class _Journal:
    """What the policy tells the index: keys that moved in the eviction order since the last
    flush, and evicted chunks (invalidated at once, R2)."""

    __slots__ = ("index", "moved")

    def __init__(self) -> None:
        self.index: RegionIndex | None = None
        self.moved: set[OffloadKey] = set()

    def evicted(self, evicted: Sequence[tuple[OffloadKey, ChunkStatus]] | None) -> None:
        index = self.index
        if index is not None and evicted:
            index.invalidate_many([chunk.chunk_id for _, chunk in evicted])


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

    def __init__(self, cache_capacity: int, journal: _Journal) -> None:
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
        check done here rather than by a method call an entry; and R2, each evicted chunk's
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

    def __init__(self, cache_capacity: int, journal: _Journal) -> None:
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
        return (_ARC_T1 if key in self.t1 else _ARC_T2, self.stamps[key])

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
            chunk, listed = t1.get(key), _ARC_T1
            if chunk is None:
                chunk, listed = t2.get(key), _ARC_T2
            if chunk is not None and chunk.ref_cnt >= 0:
                yield chunk.chunk_id, (listed, stamps[key])

    def restore(self, records: Sequence[IndexRecord], target_t1: float) -> None:
        """T1's chunks in order, then T2's (vLLM's ARC puts a ready chunk it touches in T1 at
        T2's end), with their stamps, and ARC's adaptive target."""
        context = ReqContext(req_id=_RESTORE_REQUEST)
        for record in records:
            key = OffloadKey(record.key)
            chunk = ChunkStatus(record.slot)
            chunk.ref_cnt = 0
            ARCCachePolicy.insert(self, key, chunk, context)
            if record.order[0] == _ARC_T2:
                ARCCachePolicy.touch(self, [key], context)
            self.stamps[key] = record.order[1]
        if records:
            self._stamp = max(self._stamp, max(r.order[1] for r in records))
        if target_t1 == target_t1:  # not NaN: a tenant's header holds any float
            self.target_t1_size = min(max(target_t1, 0.0), float(self.cache_capacity))


JournaledPolicy = JournaledLRU | JournaledARC


@dataclass
class WarmStart:
    """What the manager needs to keep a region's index, from the spec: where the region is,
    and its identity known at start (the hash fields follow at the first call), or why warm
    restart is off (the manager then invalidates any index it finds: its stores would
    otherwise leave records naming chunks they overwrote)."""

    directory: str
    instance_id: str
    identity: dict[str, Any] | None
    hash_algorithm: str = "sha256"
    off_reason: str = ""

    @property
    def index_path(self) -> str:
        return f"{self.directory.rstrip('/')}/{index_file_name(self.instance_id)}"


@dataclass
class _WarmReport:
    """What the first call found, for get_stats and the log."""

    restored: int = 0
    seconds: float = 0.0
    drops: list[str] = field(default_factory=list)
    reported: bool = False


class KvshmOffloadingManager(CPUOffloadingManager):
    """CPUOffloadingManager with the region's warm-restart index (docs/warm-restart.md)."""

    _policy: Any  # vLLM's CachePolicy (vLLM's types are Any here): a journaled one with an index

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
        warm: WarmStart | None = None,
    ) -> None:
        super().__init__(
            num_chunks=num_chunks,
            cache_policy=cache_policy,
            cache_policy_module_path=cache_policy_module_path,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            info=info,
        )
        self._journal = _Journal()
        self._index: RegionIndex | None = None
        self._warm = warm
        self._report = _WarmReport()
        self.warm_outcome: Outcome | None = None
        """What the first call made of the index (None before it, or without one)."""
        self._journaled: JournaledPolicy | None = None
        if warm is None:
            return
        policy_type = type(self._policy)  # vLLM's, by the name: swapped for its journaled kind
        if policy_type is LRUCachePolicy:
            self._journaled = JournaledLRU(num_chunks, self._journal)
        elif policy_type is ARCCachePolicy:
            self._journaled = JournaledARC(num_chunks, self._journal)
        if self._journaled is not None:
            self._policy = self._journaled
        elif warm.identity is not None:
            warm.identity = None
            warm.off_reason = (
                f"the cache policy {cache_policy!r} is not vLLM's lru or arc, whose eviction "
                f"order kvshm keeps"
            )
        for name in _FIRST_CALLS:  # shadowed until the first call; then the class's own again
            setattr(self, name, functools.partial(self._first_call, name))

    # -- the first call ------------------------------------------------------------------

    def _first_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._start(name):
            for shadowed in _FIRST_CALLS:
                # not through __dict__, which would materialize the instance's attribute dict
                # and slow every attribute vLLM's methods read from then on
                delattr(self, shadowed)
        return getattr(type(self), name)(self, *args, **kwargs)

    def _start(self, call: str) -> bool:
        """Adopt or drop the index; False to stay armed (a step ended before vLLM seeded its
        hashing: no request, so no key, has been seen)."""
        warm = self._warm
        assert warm is not None
        started = time.perf_counter()
        if warm.identity is None:
            self._cold(DROP_OFF, warm.off_reason, started)
            return True
        try:
            facts = hash_identity(warm.hash_algorithm)
        except HashingNotReady:
            if call == "on_schedule_end":
                return False
            why = "vLLM had not seeded its block hashing at the first request"
            self._cold(DROP_OFF, why, started)
            return True
        if not facts.reproducible:
            self._cold(DROP_OFF, facts.why_not, started)
            return True
        if facts.key_bytes > 48:
            why = f"vLLM's keys are {facts.key_bytes} bytes, the index holds 48"
            self._cold(DROP_OFF, why, started)
            return True
        identity = {**warm.identity, **facts.fields}
        try:
            index = RegionIndex.open(warm.directory, warm.instance_id, self._num_chunks)
        except (IndexUnavailable, FileNotFoundError) as exc:
            self._drop(DROP_UNAVAILABLE, f"the index cannot be used: {exc}", started)
            return True
        collecting = gc.isenabled()
        gc.disable()  # a restore makes a tuple or two a chunk: no full collection of vLLM's heap
        try:
            adoption = index.adopt(identity)
            self._journal.index = index
            self._index = index
            self._adopted(adoption, started)
        except BaseException:
            self._journal.index = self._index = None
            index.close()
            raise
        finally:
            if collecting:
                gc.enable()
        return True

    def _adopted(self, adoption: Adoption, started: float) -> None:
        index = self._index
        assert index is not None and self._warm is not None
        if not adoption.warm:
            if adoption.differences:
                reasons = [d.field for d in adoption.differences]
                why = "it was written for another identity: " + "; ".join(
                    d.describe() for d in adoption.differences
                )
            else:
                reasons = [DROP_NEW if "new index" in (adoption.problem or "") else DROP_DAMAGED]
                why = adoption.problem or ""
            self._finish(Outcome("cold", why, 0, now()), reasons, started)
            return
        self._restore(adoption.records, index.target_t1)
        note = f"; {adoption.discarded} damaged records discarded" if adoption.discarded else ""
        self._finish(Outcome("warm", note.lstrip("; "), len(adoption.records), now()), [], started)

    def _restore(self, records: list[IndexRecord], target_t1: float) -> None:
        """The pristine manager (no call has allocated a chunk yet) takes the committed chunks:
        the policy in their order, the pool with every other slot free (each invalid, R4)."""
        index = self._index
        assert index is not None
        policy = self._journaled
        assert policy is not None
        policy.restore(records, target_t1)
        used = {record.slot for record in records}
        self._num_allocated_chunks = self._num_chunks
        self._free_list = [s for s in range(self._num_chunks - 1, -1, -1) if s not in used]
        self._num_evictable_cache_chunks += len(records)
        self._journal.moved.clear()
        if records and self.events is not None:
            keys = [OffloadKey(record.key) for record in records]
            self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False))

    def _cold(self, reason: str, why: str, started: float) -> None:
        """Warm restart is off: invalidate any index the region has (this engine's stores
        would make its records lie), say why in it, and keep none."""
        warm = self._warm
        assert warm is not None
        try:
            index = RegionIndex.open(
                warm.directory, warm.instance_id, self._num_chunks, create=False
            )
        except FileNotFoundError:
            index = None
        except IndexUnavailable as exc:
            why = f"{why}; the index could not be invalidated ({exc})"
            index = None
        if index is not None:
            with index:
                index.reset()
                index.write_outcome(Outcome("cold", why, 0, now()))
        self._finish(Outcome("cold", why, 0, now()), [reason], started, write=False)

    def _drop(self, reason: str, why: str, started: float) -> None:
        self._finish(Outcome("cold", why, 0, now()), [reason], started, write=False)

    def _finish(
        self, outcome: Outcome, drops: list[str], started: float, *, write: bool = True
    ) -> None:
        if write and self._index is not None:
            self._index.write_outcome(outcome)
        self.warm_outcome = outcome
        report = self._report
        report.restored = outcome.chunks
        report.seconds = time.perf_counter() - started
        report.drops = drops
        assert self._warm is not None
        where = self._warm.index_path
        if outcome.state == "warm":
            log.info(
                "kvshm: warm restart: %s restored %d of %d chunks in %.3f s%s",
                where,
                outcome.chunks,
                self._num_chunks,
                report.seconds,
                f" ({outcome.reason})" if outcome.reason else "",
            )
        else:
            log.warning(
                "kvshm: warm restart: %s not used, the CPU tier starts cold: %s",
                where,
                outcome.reason,
            )

    # -- writing the index ---------------------------------------------------------------

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        index = self._index
        if index is None or not success:
            super().complete_store(keys, req_context, success)
            return
        journaled = self._journaled
        assert journaled is not None
        # vLLM's success path, the policy's part in one pass that also collects the commits.
        # R1: every worker reported the store of these keys complete (vLLM's connector calls
        # this once a job's last worker reported it): each key that turns ready is committed
        # (one ready before was committed when it turned ready, or restored from its record).
        commits = journaled.mark_stored(keys)
        if not commits:
            return
        self._num_write_pending_chunks -= len(commits)
        self._num_evictable_cache_chunks += len(commits)
        index.commit_many(commits)
        if self.events is not None:
            stored_keys = [key for _, key, _ in commits]
            self.events.append(OffloadingEvent(keys=stored_keys, medium=self.medium, removed=False))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        super().on_schedule_end(context)
        if self._index is not None and self._journal.moved:
            self._flush()

    def _flush(self) -> None:
        """Write the eviction order of the committed keys that moved in this step."""
        index = self._index
        assert index is not None
        policy = self._journaled
        assert policy is not None
        moved, self._journal.moved = self._journal.moved, set()
        index.set_orders(policy.committed_orders(moved))
        if isinstance(policy, JournaledARC):
            index.target_t1 = policy.target_t1_size

    def reset_cache(self) -> None:
        super().reset_cache()
        self._journal.moved.clear()
        if self._index is not None:
            self._index.reset()  # R3

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats()
        report = self._report
        if stats is not None and self.warm_outcome is not None and not report.reported:
            report.reported = True
            stats.set_gauge(RESTORED_CHUNKS, float(report.restored))
            stats.set_gauge(RESTORE_SECONDS, report.seconds)
            for reason in report.drops:
                stats.increase_counter(DROPPED, 1, (reason,))
        return stats

    def shutdown(self) -> None:
        index, self._index = self._index, None
        self._journal.index = None
        if index is not None:
            try:
                if self._journal.moved:
                    self._index = index
                    self._flush()
            finally:
                self._index = None
                index.close()
        super().shutdown()
