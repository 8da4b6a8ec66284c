"""kvshm.region.index.writer and the format it writes (kvshm.region.index.format): the
warm-restart index's rules, and a tenant's file that is never trusted (docs/warm-restart.md).
Real files on /dev/shm."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvshm.region.index.format import (
    HEADER_BYTES,
    MAX_IDENTITY_BYTES,
    MAX_KEY_BYTES,
    RECORD_BYTES,
    FieldDifference,
    Identity,
    InvalidIdentity,
    Outcome,
    identity_differences,
    index_size,
    parse_header,
)
from kvshm.region.index.writer import IndexRecord, IndexUnavailable, RegionIndex, _new_generation
from kvshm.region.naming import index_file_name

ID = "engine-a"
RECORDS = 64
IDENTITY: Identity = {"model.name": "llama", "block.tokens_per_hash": 16, "kv.replicated": False}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def index_path(directory: Path) -> Path:
    return directory / index_file_name(ID)


def fresh(directory: Path, identity: Identity = IDENTITY) -> RegionIndex:
    index = RegionIndex.open(str(directory), ID, RECORDS)
    index.adopt(identity)
    return index


def reopen(directory: Path, identity: Identity = IDENTITY) -> list[IndexRecord]:
    with RegionIndex.open(str(directory), ID, RECORDS) as index:
        return index.adopt(identity).records


def test_name_is_the_regions() -> None:
    assert index_file_name("llama") == "vllm_offload_llama.index"


def test_a_new_index_is_created_cold_sized_and_private(shm_dir: Path) -> None:
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        adoption = index.adopt(IDENTITY)
    assert not adoption.warm and adoption.records == []
    assert adoption.problem == "a new index: no engine wrote it yet"
    st = os.stat(index_path(shm_dir))
    assert st.st_size == index_size(RECORDS) == 4096 + 8192  # 4096 + 64 x 80, page-rounded
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_blocks * 512 >= st.st_size  # every page allocated: no SIGBUS on a full tmpfs


def test_committed_records_come_back_in_eviction_order(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        index.commit(5, key(5), (3, -32))
        index.commit(9, key(9), (3, -16))  # same request rank, later position: evicted first
        index.commit(2, key(2), (1, 0))
        index.commit(7, key(7), (8, 0))
        index.set_order(7, (0, 0))  # moved to the front of the eviction order
    assert [(r.slot, r.key, r.order) for r in reopen(shm_dir)] == [
        (7, key(7), (0, 0)),
        (2, key(2), (1, 0)),
        (5, key(5), (3, -32)),
        (9, key(9), (3, -16)),
    ]


def test_invalidated_and_reset_records_never_come_back(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        for slot in range(4):
            index.commit(slot, key(slot), (slot, 0))
        index.invalidate(1)
    assert [r.slot for r in reopen(shm_dir)] == [0, 2, 3]
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        index.adopt(IDENTITY)
        index.reset()
        index.commit(6, key(6), (0, 0))
    assert [r.slot for r in reopen(shm_dir)] == [6]


def test_a_changed_identity_drops_every_record_for_good(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        index.commit(0, key(0), (0, 0))
    other = {**IDENTITY, "block.tokens_per_hash": 32}
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        adoption = index.adopt(other)
    assert adoption.records == [] and not adoption.warm
    assert adoption.differences == [FieldDifference("block.tokens_per_hash", 16, 32)]
    # the old identity does not bring them back: the generation changed before the header
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        back = index.adopt(IDENTITY)
    assert back.records == [] and back.differences


def test_identity_differences_name_every_field_with_both_values() -> None:
    found = identity_differences(
        {"a": 1, "b": True, "c": "x", "gone": 1}, {"a": 1, "b": 1, "c": "y", "new": None}
    )
    assert [d.field for d in found] == ["b", "c", "gone", "new"]  # true is no 1
    assert found[1].describe() == 'c (index: "x", engine: "y")'
    assert FieldDifference("m", "x" * 500, "y").describe().endswith('..., engine: "y")')


@pytest.mark.parametrize(
    ("identity", "message"),
    [
        ({"a": [1, 2]}, "string, number, boolean or null"),
        ({"a": {"b": 1}}, "string, number, boolean or null"),
        ({"": 1}, "non-empty strings"),
        ({"a": "x" * MAX_IDENTITY_BYTES}, "digest long values"),
    ],
)
def test_an_identity_the_index_cannot_hold_is_refused(
    shm_dir: Path, identity: Any, message: str
) -> None:
    with (
        RegionIndex.open(str(shm_dir), ID, RECORDS) as index,
        pytest.raises(InvalidIdentity, match=message),
    ):
        index.adopt(identity)


def test_keys_longer_than_a_record_holds_are_refused(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        with pytest.raises(ValueError, match="1 to 48 bytes"):
            index.commit(0, b"x" * (MAX_KEY_BYTES + 1), (0, 0))
        with pytest.raises(ValueError, match="1 to 48 bytes"):
            index.commit(0, b"", (0, 0))
        index.commit(1, b"x" * MAX_KEY_BYTES, (0, 0))
    assert [r.key for r in reopen(shm_dir)] == [b"x" * MAX_KEY_BYTES]


def test_orders_beyond_64_bits_are_clamped(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        index.commit(0, key(0), (1 << 70, -(1 << 70)))
    assert reopen(shm_dir)[0].order == ((1 << 63) - 1, -(1 << 63))


def test_one_engine_writes_an_index(shm_dir: Path) -> None:
    first = RegionIndex.open(str(shm_dir), ID, RECORDS)
    try:
        with pytest.raises(IndexUnavailable, match="locked by another engine's scheduler"):
            RegionIndex.open(str(shm_dir), ID, RECORDS)
    finally:
        first.close()
    RegionIndex.open(str(shm_dir), ID, RECORDS).close()  # free again once closed


def test_outcome_round_trips_and_long_reasons_fit(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        index.write_outcome(Outcome("cold", "x" * 2000, 0, 12.5))
        outcome = index.header().outcome
    assert outcome is not None and outcome.state == "cold" and outcome.at == 12.5
    assert outcome.reason.endswith("...") and len(outcome.reason) < 400
    data = bytearray(index_path(shm_dir).read_bytes()[:HEADER_BYTES])
    data[200] ^= 0xFF  # a torn or altered outcome is none, not garbage
    assert parse_header(bytes(data)).outcome is None


def test_generations_never_tear_into_one_another() -> None:
    previous = 0x1111111122222222
    for _ in range(1000):
        new = _new_generation(previous)
        halves = {new & 0xFFFFFFFF, new >> 32}
        assert 0 not in halves and not halves & {0x11111111, 0x22222222}
        previous = new


# -- a tenant's file ---------------------------------------------------------------------


def committed(shm_dir: Path, slots: range = range(8)) -> None:
    with fresh(shm_dir) as index:
        for slot in slots:
            index.commit(slot, key(slot), (slot, 0))


def patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def record_at(slot: int) -> int:
    return HEADER_BYTES + slot * RECORD_BYTES


@pytest.mark.parametrize(
    ("where", "data", "problem"),
    [
        (0, b"NOTKVSHM", "no magic"),
        (8, struct.pack("<I", 2), "index format 2"),
        (16, struct.pack("<I", 64), "sizes 4096/64"),
        (20, struct.pack("<I", 10**9), "identity of 1000000000 bytes"),
        (24, struct.pack("<Q", 1 << 40), "1099511627776 records"),
        (1030, b"#", "checksum"),
        (64, b"\0\0\0\0", "checksum"),
    ],
)
def test_a_damaged_header_drops_the_index(
    shm_dir: Path, where: int, data: bytes, problem: str
) -> None:
    committed(shm_dir)
    patch(index_path(shm_dir), where, data)
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        adoption = index.adopt(IDENTITY)
    assert adoption.records == [] and adoption.problem is not None
    assert problem in adoption.problem
    assert reopen(shm_dir) == []  # rewritten for this engine, the old records gone


def test_damaged_records_are_discarded_and_invalidated(shm_dir: Path) -> None:
    committed(shm_dir)
    path = index_path(shm_dir)
    patch(path, record_at(1) + 20, b"\xff")  # a key byte: its CRC fails
    patch(path, record_at(2) + 8, struct.pack("<H", 0))  # no key
    patch(path, record_at(3) + 8, struct.pack("<H", 60000))  # longer than a record
    patch(path, record_at(4), struct.pack("<Q", 12345))  # another generation's commit word
    raw = path.read_bytes()
    patch(path, record_at(5) + 8, raw[record_at(6) + 8 : record_at(6) + 64])  # 6's key in 5
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        adoption = index.adopt(IDENTITY)
    assert adoption.warm and adoption.discarded == 4
    assert [r.slot for r in adoption.records] == [0, 6, 7]
    after = path.read_bytes()
    for slot in (1, 2, 3, 4, 5):  # every slot not restored is invalid on the file
        assert after[record_at(slot) : record_at(slot) + 8] == bytes(8)


def test_a_duplicate_key_keeps_its_later_used_slot(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        # never written by the protocol; a tenant can write it: the CRC binds the key to its slot
        index.commit(3, key(1), (5, 0))
        index.commit(4, key(1), (9, 0))
        index.commit(5, key(2), (1, 0))
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        adoption = index.adopt(IDENTITY)
    assert [(r.slot, r.key) for r in adoption.records] == [(5, key(2)), (4, key(1))]
    assert adoption.discarded == 1
    assert reopen(shm_dir)[-1].slot == 4


def test_garbage_of_any_size_starts_cold(shm_dir: Path) -> None:
    path = index_path(shm_dir)
    for size in (0, 100, HEADER_BYTES, index_size(RECORDS), 3 * index_size(RECORDS)):
        path.write_bytes(os.urandom(size))
        path.chmod(0o600)
        with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
            adoption = index.adopt(IDENTITY)
        assert adoption.records == [] and adoption.problem is not None
        assert path.stat().st_size == index_size(RECORDS)  # rebuilt at its size


def test_a_huge_sparse_index_is_cut_to_size(shm_dir: Path) -> None:
    path = index_path(shm_dir)
    with open(path, "wb") as f:
        f.truncate(64 << 30)  # 64 GiB of holes: nothing is read or allocated beyond the size
    path.chmod(0o600)
    with RegionIndex.open(str(shm_dir), ID, RECORDS) as index:
        assert not index.adopt(IDENTITY).warm
    assert path.stat().st_size == index_size(RECORDS)


def test_a_resized_region_drops_its_index(shm_dir: Path) -> None:
    committed(shm_dir)
    with RegionIndex.open(str(shm_dir), ID, RECORDS * 2) as index:
        adoption = index.adopt(IDENTITY)
    assert adoption.records == []
    assert adoption.problem == "the index has 64 records, the region 128 chunks"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "hardlink"])
def test_what_is_no_regular_file_is_never_opened(shm_dir: Path, kind: str) -> None:
    path = index_path(shm_dir)
    target = shm_dir / "target"
    target.write_bytes(b"keep")
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        os.link(target, path)
    with pytest.raises(IndexUnavailable, match="not opened"):
        RegionIndex.open(str(shm_dir), ID, RECORDS)
    assert target.read_bytes() == b"keep"


def test_a_full_tmpfs_is_an_unavailable_index_not_a_sigbus(small_tmpfs: Path) -> None:
    filler = small_tmpfs / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"],
        check=False,
        capture_output=True,
    )
    with pytest.raises(IndexUnavailable, match="no space left"):
        RegionIndex.open(str(small_tmpfs), ID, 100_000)


def test_a_torn_commit_word_is_no_record(shm_dir: Path) -> None:
    """A word half-written (by a commit, or an invalidation over one) is valid neither way."""
    committed(shm_dir, range(4))
    path = index_path(shm_dir)
    patch(path, record_at(0), bytes(4))  # the low half of an invalidation landed
    patch(path, record_at(1) + 4, bytes(4))  # the high half
    word = path.read_bytes()[record_at(2) : record_at(2) + 8]
    patch(path, record_at(3), word[:4] + bytes(4))  # a commit killed between its halves
    assert [r.slot for r in reopen(shm_dir)] == [2]


def test_a_body_without_its_commit_word_is_no_record(shm_dir: Path) -> None:
    with fresh(shm_dir) as index:
        index.commit(0, key(0), (0, 0))
        index.commit(1, key(1), (0, 0))
    patch(index_path(shm_dir), record_at(1), bytes(8))  # killed after the body, before the word
    assert [r.slot for r in reopen(shm_dir)] == [0]
