"""kvshm.vllm.warm.journal: the one owner of a region's index in the plugin's scheduler. What
it writes is read back through a RegionIndex of its own, on a real tmpfs file, as a restarted
engine would."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvshm.region.index.format import Outcome, parse_header
from kvshm.region.index.writer import IndexRecord, IndexUnavailable, RegionIndex
from kvshm.region.naming import index_file_name
from kvshm.vllm.warm.journal import IndexJournal

ID = "journal"
RECORDS = 16
IDENTITY = {"model.name": "llama"}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def restored(directory: Path) -> list[IndexRecord]:
    """What a restarted engine of the same identity would start with."""
    with RegionIndex.open(str(directory), ID, RECORDS) as index:
        return index.adopt(IDENTITY).records


def kept(directory: Path) -> IndexJournal:
    journal = IndexJournal()
    journal.open(str(directory), ID, RECORDS)
    journal.adopt(IDENTITY)
    return journal


def test_commits_evictions_orders_and_resets_reach_the_file(shm_dir: Path) -> None:
    journal = kept(shm_dir)
    assert journal.keeping
    journal.commit([(slot, key(slot), (slot, 0)) for slot in range(4)])
    journal.evicted([(key(1), ChunkStatus(1))])
    journal.write_orders([(0, (9, 0))], 5.0)  # ARC's target with it
    journal.close()
    assert not journal.keeping
    assert [(r.slot, r.order) for r in restored(shm_dir)] == [(2, (2, 0)), (3, (3, 0)), (0, (9, 0))]

    journal = kept(shm_dir)
    assert journal.target_t1 == 5.0
    journal.reset()
    journal.close()
    assert restored(shm_dir) == []


def test_the_journal_holds_the_engines_lock_until_it_closes(shm_dir: Path) -> None:
    journal = kept(shm_dir)
    with pytest.raises(IndexUnavailable, match="locked by another engine"):
        RegionIndex.open(str(shm_dir), ID, RECORDS)
    with pytest.raises(ValueError, match="open already"):
        journal.open(str(shm_dir), ID, RECORDS)
    journal.close()
    journal.close()  # idempotent
    RegionIndex.open(str(shm_dir), ID, RECORDS).close()


def test_without_an_index_the_journal_writes_nothing(shm_dir: Path) -> None:
    journal = IndexJournal()
    journal.commit([(0, key(0), (0, 0))])
    journal.evicted([(key(0), ChunkStatus(0))])
    journal.write_orders([(0, (1, 0))], 3.0)
    journal.write_outcome(Outcome("cold", "off"))
    journal.reset()
    assert journal.target_t1 == 0.0
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(ValueError, match="no index is open"):
        journal.adopt(IDENTITY)


def test_an_index_it_cannot_keep_is_invalidated_or_removed(shm_dir: Path) -> None:
    IndexJournal.invalidate(str(shm_dir), ID, RECORDS, Outcome("cold", "off"))
    assert list(shm_dir.iterdir()) == []  # none made where there was none
    journal = kept(shm_dir)
    journal.commit([(0, key(0), (0, 0))])
    journal.close()
    IndexJournal.invalidate(str(shm_dir), ID, RECORDS, Outcome("cold", "warm restart off"))
    header = parse_header((shm_dir / index_file_name(ID)).read_bytes())
    assert header.outcome is not None and header.outcome.reason == "warm restart off"
    assert restored(shm_dir) == []
    assert IndexJournal.remove(str(shm_dir), ID) is True
    assert not (shm_dir / index_file_name(ID)).exists()
