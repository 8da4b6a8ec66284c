"""The index's commit protocol under SIGKILL at random moments (docs/warm-restart.md).

A forked writer follows the protocol on a real tmpfs region and its index, as the plugin's
manager and workers do together: restore, then forever pick a key, evict the least recently
used chunk when full (its record invalidated first), write the chunk's bytes in pieces (a
worker's store), commit once they are complete, move hit keys in the eviction order, now and
then reset.
The test kills it with SIGKILL after a random delay, many times, and after each kill restores
the index and reads every restored chunk's bytes: each must be its key's complete pattern.
The region's bytes are the ground truth, so a record naming a chunk whose store did not
complete (mid-store, mid-eviction, mid-commit) is caught by what the chunk holds.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
from collections import OrderedDict
from functools import partial
from pathlib import Path

from tests.sigkill import fork_and_kill

from kvshm.region.index.writer import RegionIndex

ID = "crash"
SLOTS = 48
ROW = 16384
PIECES = 8
KEYS = 160  # more keys than slots: evictions all the time
IDENTITY = {"test": "crash"}
KILLS = int(os.environ.get("KVSHM_INDEX_KILLS", "300"))


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest() + b"\0\0\0\0"


def pattern(k: bytes) -> bytes:
    return (hashlib.sha256(k).digest() * (ROW // 32))[:ROW]


def writer(directory: Path, seed: int) -> None:
    """The manager and its workers, in one process, following the protocol until killed."""
    rng = random.Random(seed)
    fd = os.open(directory / "region", os.O_RDWR)
    region = mmap.mmap(fd, SLOTS * ROW)
    index = RegionIndex.open(str(directory), ID, SLOTS)
    resident: OrderedDict[bytes, int] = OrderedDict()
    records = index.adopt(IDENTITY).records  # killed here too: mid-restore (its invalidations)
    for record in records:  # in eviction order: the least recently used first
        resident[record.key] = record.slot
    free = [slot for slot in range(SLOTS) if slot not in set(resident.values())]
    tick = max((record.order[0] for record in records), default=0)
    piece = ROW // PIECES
    while True:
        k = key(rng.randrange(KEYS))
        tick += 1
        if k in resident:
            resident.move_to_end(k)
            index.set_order(resident[k], (tick, 0))
            continue
        if free:
            slot = free.pop()
        else:
            _, slot = resident.popitem(last=False)
            index.invalidate(slot)  # before the new store's bytes land
        data = pattern(k)
        for i in range(PIECES):  # the worker's store, in pieces: killed mid-store too
            region[slot * ROW + i * piece : slot * ROW + (i + 1) * piece] = data[
                i * piece : (i + 1) * piece
            ]
        index.commit(slot, k, (tick, 0))  # after the store completed
        resident[k] = slot
        if rng.random() < 0.003:
            index.reset()
            resident.clear()
            free = list(range(SLOTS))


def check(directory: Path) -> int:
    """Restore the index as a new engine would; every restored chunk must hold its key's
    complete bytes. Returns how many were restored."""
    with open(directory / "region", "rb") as f:
        region = f.read()
    with RegionIndex.open(str(directory), ID, SLOTS) as index:
        records = index.adopt(IDENTITY).records
    for record in records:
        row = region[record.slot * ROW : (record.slot + 1) * ROW]
        assert row == pattern(record.key), (
            f"slot {record.slot} is restored for a key whose bytes it does not hold "
            f"({sum(a != b for a, b in zip(row, pattern(record.key), strict=True))} bytes differ)"
        )
    return len(records)


def test_no_chunk_whose_store_did_not_complete_is_ever_restored(shm_dir: Path) -> None:
    (shm_dir / "region").write_bytes(bytes(SLOTS * ROW))
    rng = random.Random(34)
    restored = []
    for round_ in range(KILLS):
        delay = rng.uniform(0.0005, 0.02)
        fork_and_kill(partial(writer, shm_dir, round_), shm_dir / "child-failure", after=delay)
        restored.append(check(shm_dir))
    assert len(restored) >= 200
    # the kills landed while chunks were held, not only before the first store
    assert sum(1 for n in restored if n) > KILLS // 2
