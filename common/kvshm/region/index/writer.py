"""The warm-restart index as its one engine writes it: RegionIndex opens, locks, sizes and maps
the file, adopts or drops what it holds (the identity, then every record), and keeps the commit
protocol's rules as vLLM's manager calls change chunks; remove_index takes the name of an index
an engine cannot use.

docs/warm-restart.md is the design: the commit protocol ("The rules"), and why it survives
SIGKILL. The header's layout and checks are kvshm.region.index.format's. Only the plugin's
scheduler (kvshm.vllm.warm.journal) writes an index; the agent never imports this module.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

from kvshm.region import safefile
from kvshm.region.errors import UnsafePathError
from kvshm.region.index.format import (
    FLOAT64,
    FORMAT_VERSION,
    GENERATION_AT,
    HEADER_BYTES,
    I64_MAX,
    IDENTITY_AT,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_RECORDS,
    OUTCOME_AT,
    OUTCOME_END,
    RECORD_BYTES,
    STATIC,
    STATIC_CHECK_AT,
    TARGET_T1_AT,
    UINT32,
    UINT64,
    FieldDifference,
    Identity,
    IndexError_,
    IndexHeader,
    Outcome,
    identity_differences,
    identity_document,
    index_size,
    parse_header,
)
from kvshm.region.locks import try_lock_byte
from kvshm.region.naming import index_file_name

INDEX_MODE: Final = 0o600

# record: commit word; key length, 2 reserved bytes, CRC-32; key; eviction order (two i64)
_RECORD = struct.Struct("<QHxxI48sqq")
_BODY = struct.Struct("<HxxI48sqq")  # the record after its commit word, written first
_ORDER = struct.Struct("<qq")
_ORDER_AT: Final = 64
_SLOT_MIX: Final = 0x9E3779B1  # spreads slot numbers over the CRC's seed


def _key_check(slot: int, generation: int, key: bytes) -> int:
    """A record's check: CRC-32 of its key, seeded with its slot and generation, so a key
    copied to another slot or left from another generation fails (one C call a commit)."""
    return zlib.crc32(key, (slot * _SLOT_MIX ^ generation ^ (generation >> 32)) & 0xFFFFFFFF)


_I64_MIN: Final = -(1 << 63)
assert _RECORD.size == RECORD_BYTES


class IndexUnavailable(IndexError_):
    """The index cannot be used by this engine (busy, no space, not a regular file): it starts
    cold and says why; the engine itself runs on."""


def remove_index(directory: str, instance_id: str) -> bool:
    """Remove the name of region `instance_id`'s index in `directory`, whatever it is (never
    following, opening or locking it), so that no later engine adopts its records: what an
    engine that cannot use the index does before it writes the region. True if a file was
    removed; False if none had the name (a directory there is left: no engine opens it as an
    index). IndexUnavailable if the name stays (the directory cannot be opened or written)."""
    name = index_file_name(instance_id)
    path = os.path.join(directory, name)
    try:
        dir_fd = safefile.open_directory(directory)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise IndexUnavailable(f"{directory} cannot be opened ({exc.strerror})") from exc
    try:
        os.unlink(name, dir_fd=dir_fd)
    except (FileNotFoundError, IsADirectoryError):
        return False
    except OSError as exc:
        raise IndexUnavailable(f"{path} cannot be removed ({exc.strerror})") from exc
    finally:
        os.close(dir_fd)
    return True


def _new_generation(previous: int) -> int:
    """A random 64-bit generation whose 32-bit halves are non-zero and unlike the previous
    one's: a word torn between 0, the old and the new generation then equals none of them."""
    old = {previous & 0xFFFFFFFF, previous >> 32}
    while True:
        value = int.from_bytes(os.urandom(8), "little")
        low, high = value & 0xFFFFFFFF, value >> 32
        if low and high and low not in old and high not in old:
            return value


def _clamp(value: int) -> int:
    return min(max(int(value), _I64_MIN), I64_MAX)


class IndexRecord(NamedTuple):
    """A valid record: chunk `slot` holds the complete bytes of `key`; `order` sorts the chunks
    as the old engine's policy would evict them (ascending: first evicted first). A tuple: a
    restore makes one per chunk."""

    slot: int
    key: bytes
    order: tuple[int, int]


def _eviction_order(record: IndexRecord) -> tuple[tuple[int, int], int]:
    return record.order, record.slot


@dataclass(frozen=True)
class Adoption:
    """What opening the index for an engine gave: the records restored, or why none were."""

    records: list[IndexRecord]
    differences: list[FieldDifference]
    problem: str | None
    """Why the index was dropped other than an identity difference (a new, corrupt or resized
    index); None when it was adopted or differs only in identity."""
    discarded: int = 0
    """Records that looked committed but failed their checks (torn, altered, duplicate)."""

    @property
    def warm(self) -> bool:
        return not self.differences and self.problem is None


class RegionIndex:
    """The index file of one region, open, locked and mapped for the one engine that writes it.

    Writes follow docs/warm-restart.md's rules: commit() writes a record's body before its
    commit word, invalidate() and reset() invalidate before they return, adopt() invalidates
    every slot it does not restore. Nothing here waits or flushes: the mapping is a tmpfs
    file's page cache, which outlives the process.
    """

    def __init__(self, path: str, fd: int, records: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.records = records
        self._fd = fd
        self._map: mmap.mmap | None = mapping
        self._generation = UINT64.unpack_from(mapping, GENERATION_AT)[0]

    @classmethod
    def open(
        cls, directory: str, instance_id: str, records: int, *, create: bool = True
    ) -> RegionIndex:
        """Open (creating it if missing, unless not `create`: FileNotFoundError) the index of
        region `instance_id` in `directory`, lock it for this engine, size it for `records`
        chunk slots with every page allocated, and map it. IndexUnavailable says why it cannot
        be used."""
        if not 0 < records <= MAX_RECORDS:
            raise ValueError(f"an index holds 1 to {MAX_RECORDS} records, not {records}")
        name = index_file_name(instance_id)
        path = os.path.join(directory, name)
        try:
            dir_fd = safefile.open_directory(directory)
        except OSError as exc:
            raise IndexUnavailable(f"{directory} cannot be opened ({exc.strerror})") from exc
        try:
            fd = safefile.create_exclusive(dir_fd, name, INDEX_MODE) if create else None
            if fd is None:
                fd = safefile.open_existing(dir_fd, name, path)
        except FileNotFoundError:
            raise
        except UnsafePathError as exc:
            raise IndexUnavailable(str(exc)) from exc
        except OSError as exc:
            raise IndexUnavailable(f"{path} cannot be opened ({exc.strerror})") from exc
        finally:
            os.close(dir_fd)
        try:
            return cls._map_locked(path, fd, records)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _map_locked(cls, path: str, fd: int, records: int) -> RegionIndex:
        if not try_lock_byte(fd, 0):
            raise IndexUnavailable(
                f"{path} is locked by another engine's scheduler: this engine keeps no index"
            )
        size = index_size(records)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a tenant's other size: rebuilt (the header says so)
            # every page allocated now: a write into a hole of a full tmpfs would be a SIGBUS
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            reason = "no space left on the tmpfs" if exc.errno == errno.ENOSPC else exc.strerror
            raise IndexUnavailable(f"{path} cannot be sized to {size} bytes ({reason})") from exc
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(path, fd, records, mapping)

    # -- header --------------------------------------------------------------------------

    @property
    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError(f"the index {self.path} is closed")
        return self._map

    def header(self) -> IndexHeader:
        return parse_header(bytes(self._mapping[:HEADER_BYTES]), self.records)

    def reinitialize(self, identity: Identity) -> None:
        """Drop every record and write a header for `identity`: the generation first (every
        record is invalid from that store on), then the static part and its check."""
        document = identity_document(identity)
        mapping = self._mapping
        self._set_generation(_new_generation(self._generation))
        FLOAT64.pack_into(mapping, TARGET_T1_AT, 0.0)
        mapping[IDENTITY_AT:HEADER_BYTES] = bytes(HEADER_BYTES - IDENTITY_AT)
        mapping[IDENTITY_AT : IDENTITY_AT + len(document)] = document
        STATIC.pack_into(
            mapping,
            0,
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            RECORD_BYTES,
            len(document),
            self.records,
            hashlib.sha256(document).digest(),
        )
        check = zlib.crc32(document, zlib.crc32(mapping[:STATIC_CHECK_AT]))
        UINT32.pack_into(mapping, STATIC_CHECK_AT, check)

    def _set_generation(self, generation: int) -> None:
        UINT64.pack_into(self._mapping, GENERATION_AT, generation)
        self._generation = generation

    def adopt(self, identity: Identity) -> Adoption:
        """Use the index for an engine of `identity`: if its header is sound and its identity
        equal, restore every valid record (and invalidate every other slot); else drop it and
        write a header for `identity`."""
        # the identity first: a region resized by another geometry is named by its fields
        header = parse_header(bytes(self._mapping[:HEADER_BYTES]))
        if header.identity is None:
            self.reinitialize(identity)
            return Adoption([], [], header.problem)
        differences = identity_differences(header.identity, identity)
        if differences:
            self.reinitialize(identity)
            return Adoption([], differences, None)
        if header.records != self.records:
            self.reinitialize(identity)
            return Adoption(
                [], [], f"the index has {header.records} records, the region {self.records} chunks"
            )
        if not self._generation:
            self.reinitialize(identity)
            return Adoption([], [], "the index has no generation (never committed to)")
        records, discarded = self._restore()
        return Adoption(records, [], None, discarded)

    def _restore(self) -> tuple[list[IndexRecord], int]:
        generation = self._generation
        mixed = generation ^ (generation >> 32)
        crc32 = zlib.crc32
        by_key: dict[bytes, IndexRecord] = {}
        invalid: list[int] = []
        discarded = 0
        view = memoryview(self._mapping)[HEADER_BYTES : HEADER_BYTES + self.records * RECORD_BYTES]
        try:
            for slot, (word, length, crc, key, major, minor) in enumerate(
                _RECORD.iter_unpack(view)
            ):
                if word != generation:
                    if word:
                        invalid.append(slot)
                    continue
                key = key[:length]
                if (
                    not 0 < length <= MAX_KEY_BYTES
                    or crc != crc32(key, (slot * _SLOT_MIX ^ mixed) & 0xFFFFFFFF)  # _key_check
                ):
                    invalid.append(slot)
                    discarded += 1
                    continue
                record = IndexRecord(slot, key, (major, minor))
                other = by_key.get(key)
                if other is not None:  # never written by the protocol: keep the later-used one
                    discarded += 1
                    keep, drop = (record, other) if record.order > other.order else (other, record)
                    invalid.append(drop.slot)
                    record = keep
                by_key[key] = record
        finally:
            view.release()
        self.invalidate_many(invalid)  # every slot that enters the free list is invalid first
        records = list(by_key.values())
        records.sort(key=_eviction_order)
        return records, discarded

    # -- records -------------------------------------------------------------------------

    def commit(self, slot: int, key: bytes, order: tuple[int, int]) -> None:
        """Record that chunk `slot` holds the complete bytes of `key` (its store completed on
        every worker): the body first, the commit word last."""
        self.commit_many(((slot, key, order),))

    def commit_many(self, records: Iterable[tuple[int, bytes, tuple[int, int]]]) -> None:
        """commit() for many (slot, key, order) at once (a completed store job's chunks)."""
        generation = self._generation
        mixed = generation ^ (generation >> 32)
        mapping = self._mapping
        body, word, crc32 = _BODY.pack_into, UINT64.pack_into, zlib.crc32
        for slot, key, (major, minor) in records:
            length = len(key)
            if not 0 < length <= MAX_KEY_BYTES:
                raise ValueError(f"index keys are 1 to {MAX_KEY_BYTES} bytes, got {length}")
            at = HEADER_BYTES + slot * RECORD_BYTES
            crc = crc32(key, (slot * _SLOT_MIX ^ mixed) & 0xFFFFFFFF)  # _key_check, inlined
            try:
                body(mapping, at + 8, length, crc, key, major, minor)
            except struct.error:  # beyond 64 bits: clamped (only order suffers)
                body(mapping, at + 8, length, crc, key, _clamp(major), _clamp(minor))
            word(mapping, at, generation)

    def invalidate(self, slot: int) -> None:
        """Chunk `slot` no longer holds its key's bytes, or soon will not (evicted, or about to
        enter the free list)."""
        UINT64.pack_into(self._mapping, HEADER_BYTES + slot * RECORD_BYTES, 0)

    def invalidate_many(self, slots: Iterable[int]) -> None:
        mapping, word = self._mapping, UINT64.pack_into
        for slot in slots:
            word(mapping, HEADER_BYTES + slot * RECORD_BYTES, 0)

    def set_order(self, slot: int, order: tuple[int, int]) -> None:
        """Where a committed chunk stands in the eviction order now (outside its check: a torn
        order costs order, never validity)."""
        self.set_orders(((slot, order),))

    def set_orders(self, orders: Iterable[tuple[int, tuple[int, int]]]) -> None:
        """set_order for many (slot, order) pairs at once (a scheduler step's moved keys)."""
        mapping = self._mapping
        pack = _ORDER.pack_into
        for slot, (major, minor) in orders:
            at = _ORDER_AT + HEADER_BYTES + slot * RECORD_BYTES
            try:
                pack(mapping, at, major, minor)
            except struct.error:
                pack(mapping, at, _clamp(major), _clamp(minor))

    def reset(self) -> None:
        """Invalidate every record at once (vLLM's reset_cache)."""
        self._set_generation(_new_generation(self._generation))

    @property
    def target_t1(self) -> float:
        value: float = FLOAT64.unpack_from(self._mapping, TARGET_T1_AT)[0]
        return value

    @target_t1.setter
    def target_t1(self, value: float) -> None:
        FLOAT64.pack_into(self._mapping, TARGET_T1_AT, float(value))

    def write_outcome(self, outcome: Outcome) -> None:
        block = outcome.encode()
        mapping = self._mapping
        mapping[OUTCOME_AT:OUTCOME_END] = block + bytes(OUTCOME_END - OUTCOME_AT - len(block))

    def close(self) -> None:
        """Unmap and close (which drops the lock); idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RegionIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
