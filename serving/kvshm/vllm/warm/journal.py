"""IndexJournal: the one owner of a region's warm-restart index in the plugin's scheduler.

Every write to the index goes through it, and it alone holds the open RegionIndex: the manager
(kvshm.vllm.warm.manager) asks it to adopt the index at the first call, or to invalidate or
remove one this engine cannot keep, then to commit completed stores, write the step's moved
orders, reset and close; the journaled policies (kvshm.vllm.warm.policies), given the same
journal when they are made, note the keys that moved and hand it their evicted chunks. Which
write each of vLLM's calls owes, and why the file survives a SIGKILL: docs/warm-restart.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvshm.region.index.format import Identity, Outcome
from kvshm.region.index.writer import Adoption, RegionIndex, remove_index
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

Commit = tuple[int, OffloadKey, tuple[int, int]]  # a chunk's slot, key and eviction order
Order = tuple[int, tuple[int, int]]  # a chunk's slot and eviction order


class IndexJournal:
    """The region's index while this engine keeps it (none before the first call, or when it
    runs cold), and the keys whose eviction order moved since the last flush."""

    __slots__ = ("_index", "moved")

    def __init__(self) -> None:
        self._index: RegionIndex | None = None
        self.moved: set[OffloadKey] = set()

    @property
    def keeping(self) -> bool:
        """Whether this engine keeps the index (it adopted it and has not closed it)."""
        return self._index is not None

    # -- the first call: adopt, or leave no index that could lie -------------------------

    def open(self, directory: str, instance_id: str, records: int) -> None:
        """Open (creating it if missing) and lock the region's index, sized for `records`
        chunks, and keep it. IndexUnavailable (or FileNotFoundError) if it cannot be opened:
        nothing is kept."""
        if self._index is not None:
            raise ValueError(f"the index {self._index.path} is open already")
        self._index = RegionIndex.open(directory, instance_id, records)

    def adopt(self, identity: Identity) -> Adoption:
        """Adopt the open index for an engine of `identity`: its records restored, or dropped
        and its header written anew for `identity` (RegionIndex.adopt)."""
        if self._index is None:
            raise ValueError("no index is open")
        return self._index.adopt(identity)

    @staticmethod
    def invalidate(directory: str, instance_id: str, records: int, outcome: Outcome) -> None:
        """With warm restart off: every record of an existing index invalid at once, and
        `outcome` in its header; no index is kept. Nothing to do where there is none;
        IndexUnavailable if it cannot be opened."""
        try:
            index = RegionIndex.open(directory, instance_id, records, create=False)
        except FileNotFoundError:
            return
        with index:
            index.reset()
            index.write_outcome(outcome)

    @staticmethod
    def remove(directory: str, instance_id: str) -> bool:
        """Remove the name of an index this engine cannot use (remove_index): True if a file
        was removed; IndexUnavailable if the name stays."""
        return remove_index(directory, instance_id)

    @property
    def target_t1(self) -> float:
        """ARC's adaptive target as the adopted index holds it (0.0 without an index)."""
        return self._index.target_t1 if self._index is not None else 0.0

    def write_outcome(self, outcome: Outcome) -> None:
        if self._index is not None:
            self._index.write_outcome(outcome)

    # -- the manager's and the policies' calls ------------------------------------------

    def commit(self, commits: Sequence[Commit]) -> None:
        """Every worker reported these chunks' stores complete: their records committed."""
        index = self._index
        if index is not None:
            index.commit_many(commits)

    def evicted(self, evicted: Sequence[tuple[OffloadKey, ChunkStatus]] | None) -> None:
        """The policy evicted these chunks, whose slots a store may now target: their records
        invalid before the policy hands them back."""
        index = self._index
        if index is not None and evicted:
            index.invalidate_many([chunk.chunk_id for _, chunk in evicted])

    def write_orders(self, orders: Iterable[Order], target_t1: float | None) -> None:
        """The eviction order of committed chunks that moved (and ARC's target, if given)."""
        index = self._index
        if index is None:
            return
        index.set_orders(orders)
        if target_t1 is not None:
            index.target_t1 = target_t1

    def take_moved(self) -> set[OffloadKey]:
        """The keys that moved since the last call, and a new empty journal of moves."""
        moved, self.moved = self.moved, set()
        return moved

    def reset(self) -> None:
        """vLLM's reset_cache: every record invalid at once, and no move left to write."""
        self.moved.clear()
        if self._index is not None:
            self._index.reset()

    def close(self) -> None:
        """Let the index go (its lock with it); idempotent."""
        index, self._index = self._index, None
        if index is not None:
            index.close()
