"""KvshmOffloadingManager: vLLM 0.33's CPUOffloadingManager (its LRU or ARC policy,
store_threshold, events and stats), keeping the warm-restart index of its region, so a
restarted engine of the same identity starts with every chunk whose store completed, in the
same eviction order (docs/warm-restart.md).

The index is written, through its one owner (kvshm.vllm.warm.journal), where vLLM's contract
says a chunk changed: complete_store commits (all workers reported the store), the policy's
evict invalidates inside prepare_store (before the new store's job reaches a worker),
reset_cache moves to a new generation, and each step's end writes the eviction order of the
keys that moved. The manager starts warm or cold (_start) at its first call, whichever of
FIRST_CALLS it is (kvshm.vllm.warm.first_call): vLLM seeds its block hashing (init_none_hash)
only after it has built the scheduler. An index it cannot use is removed before its first
store, or it stores nothing: left in place, its records would name rows this engine's stores
reuse.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvshm.region.index.format import Outcome, now
from kvshm.region.index.writer import Adoption, IndexRecord, IndexUnavailable
from kvshm.region.naming import index_file_name
from kvshm.vllm.warm.first_call import FirstCall
from kvshm.vllm.warm.identity import HashingNotReady, hash_identity
from kvshm.vllm.warm.journal import IndexJournal
from kvshm.vllm.warm.policies import JournaledARC, JournaledLRU, JournaledPolicy
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

log = logging.getLogger(__name__)

RESTORED_CHUNKS = "kvshm_warm_index_restored_chunks"
RESTORE_SECONDS = "kvshm_warm_index_restore_seconds"
DROPPED = "kvshm_warm_index_dropped"
STORES_OFF = "kvshm_warm_index_stores_off"
# what a drop is counted by: an identity field's name, or one of these
DROP_NEW, DROP_DAMAGED, DROP_UNAVAILABLE, DROP_OFF = "new", "damaged", "unavailable", "off"

# the manager's calls that can come first: the first of them starts it warm or cold (_start)
FIRST_CALLS = ("on_new_request", "lookup", "prepare_store", "touch", "on_schedule_end")


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
        STORES_OFF: OffloadingGaugeMetadata(
            documentation="1 when this engine's CPU tier stores nothing: the region's "
            "warm-restart index could neither be used nor removed, and a later engine would "
            "restore its records over rows this engine stored into."
        ),
    }


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
        self._journal = IndexJournal()
        self._warm = warm
        self._report = _WarmReport()
        self.warm_outcome: Outcome | None = None
        """What the first call made of the index (None before it, or without one)."""
        self.stores_off = False
        """The index could neither be used nor removed: prepare_store stores nothing."""
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
        self._first_call = FirstCall(self, FIRST_CALLS, self._start)

    # -- the first call ------------------------------------------------------------------

    def _start(self, call: str) -> bool:
        """Adopt or drop the index, at the first of FIRST_CALLS; False to start at the next
        call instead (a step ended before vLLM seeded its hashing: no request, so no key, has
        been seen)."""
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
        journal = self._journal
        try:
            journal.open(warm.directory, warm.instance_id, self._num_chunks)
        except (IndexUnavailable, FileNotFoundError) as exc:
            self._unindexed(DROP_UNAVAILABLE, f"the index cannot be used: {exc}", started)
            return True
        collecting = gc.isenabled()
        gc.disable()  # a restore makes a tuple or two a chunk: no full collection of vLLM's heap
        try:
            self._adopted(journal.adopt(identity), started)
        except BaseException:
            journal.close()
            raise
        finally:
            if collecting:
                gc.enable()
        return True

    def _adopted(self, adoption: Adoption, started: float) -> None:
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
        self._restore(adoption.records, self._journal.target_t1)
        note = f"; {adoption.discarded} damaged records discarded" if adoption.discarded else ""
        self._finish(Outcome("warm", note.lstrip("; "), len(adoption.records), now()), [], started)

    def _restore(self, records: list[IndexRecord], target_t1: float) -> None:
        """The pristine manager (no call has allocated a chunk yet) takes the committed chunks:
        the policy in their order, the pool with every other slot free (the index invalidated
        each of them when it adopted)."""
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
            self._journal.invalidate(
                warm.directory, warm.instance_id, self._num_chunks, Outcome("cold", why, 0, now())
            )
        except IndexUnavailable as exc:
            self._unindexed(reason, f"{why}; the index cannot be invalidated ({exc})", started)
            return
        self._finish(Outcome("cold", why, 0, now()), [reason], started, write=False)

    def _unindexed(self, reason: str, why: str, started: float) -> None:
        """Run without an index this engine cannot use, whose records must then name no row
        it stores into: the index is removed before the first store, or nothing is stored."""
        warm = self._warm
        assert warm is not None
        try:
            removed = self._journal.remove(warm.directory, warm.instance_id)
        except IndexUnavailable as exc:
            self.stores_off = True
            # for the engine's life, found before the class's method: stores pay no check
            self.prepare_store = self._store_nothing
            why = (
                f"{why}; nor can it be removed ({exc}), so this engine stores nothing in the "
                f"region: a later engine would restore records naming rows it stored into"
            )
        else:
            if removed:
                why = f"{why}; it was removed, so no later engine restores what it named"
        self._finish(Outcome("cold", why, 0, now()), [reason], started, write=False)

    def _store_nothing(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        """prepare_store while stores are off: no key is stored, nothing evicted (vLLM's
        scheduler then moves on without a store job or a warning)."""
        return PrepareStoreOutput(
            keys_to_store=[], store_spec=self._get_load_store_spec([], []), evicted_keys=[]
        )

    def _finish(
        self, outcome: Outcome, drops: list[str], started: float, *, write: bool = True
    ) -> None:
        if write:
            self._journal.write_outcome(outcome)
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
        journal = self._journal
        if not success or not journal.keeping:
            super().complete_store(keys, req_context, success)
            return
        journaled = self._journaled
        assert journaled is not None
        # vLLM's success path, the policy's part in one pass that also collects the commits.
        # Every worker reported the store of these keys complete (vLLM's connector calls this
        # once a job's last worker reported it), the one moment a chunk's record may become
        # valid: each key that turns ready is committed (one ready before was committed when
        # it turned ready, or restored from its record).
        commits = journaled.mark_stored(keys)
        if not commits:
            return
        self._num_write_pending_chunks -= len(commits)
        self._num_evictable_cache_chunks += len(commits)
        journal.commit(commits)
        if self.events is not None:
            stored_keys = [key for _, key, _ in commits]
            self.events.append(OffloadingEvent(keys=stored_keys, medium=self.medium, removed=False))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        super().on_schedule_end(context)
        journal = self._journal
        if journal.moved:
            if journal.keeping:
                self._flush()
            else:  # no index to write them to: kept, they would grow with every key served
                journal.moved.clear()

    def _flush(self) -> None:
        """Write the eviction order of the committed keys that moved in this step."""
        policy = self._journaled
        assert policy is not None
        journal = self._journal
        orders = policy.committed_orders(journal.take_moved())
        journal.write_orders(
            orders, policy.target_t1_size if isinstance(policy, JournaledARC) else None
        )

    def reset_cache(self) -> None:
        super().reset_cache()
        self._journal.reset()  # a new generation: every record invalid before this returns

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats()
        report = self._report
        if stats is not None and self.warm_outcome is not None and not report.reported:
            report.reported = True
            stats.set_gauge(RESTORED_CHUNKS, float(report.restored))
            stats.set_gauge(RESTORE_SECONDS, report.seconds)
            stats.set_gauge(STORES_OFF, float(self.stores_off))
            for reason in report.drops:
                stats.increase_counter(DROPPED, 1, (reason,))
        return stats

    def shutdown(self) -> None:
        journal = self._journal
        try:
            if journal.moved and journal.keeping:
                self._flush()
        finally:
            journal.close()
        super().shutdown()
