"""A region's warm-restart index: which chunk slot holds the complete bytes of which key.

The plugin's scheduler-side manager keeps it beside the region (vllm_offload_<id>.index) so a
restarted engine of the same identity starts with every chunk whose store completed, and never
with one whose store did not; the agent reads its header for the OffloadRegion's status.
docs/warm-restart.md is the design: the format, the commit protocol, why it survives SIGKILL.

Pure Python (struct, mmap, zlib): the agent imports it and no numpy. The file is the tenant's,
so nothing read from it is trusted: every size is checked before use and a bad file makes the
engine start cold, never fail.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from kvshm.region import safefile
from kvshm.region.errors import RegionError, UnsafePathError
from kvshm.region.locks import try_lock_byte
from kvshm.region.naming import index_file_name

MAGIC: Final = b"KVSHMIDX"
FORMAT_VERSION: Final = 1
HEADER_BYTES: Final = 4096
RECORD_BYTES: Final = 80
MAX_KEY_BYTES: Final = 48  # vLLM 0.33's OffloadKey: a 32-byte sha256 block hash + 4 group bytes
MAX_IDENTITY_BYTES: Final = 3072
MAX_RECORDS: Final = 1 << 32  # a bound on a tenant's header, far above any region's chunks
INDEX_MODE: Final = 0o600

# header: magic, version, header bytes, record bytes, identity bytes, records, identity digest
_STATIC = struct.Struct("<8sIIII Q 32s")
_STATIC_CHECK_AT: Final = 64  # CRC-32 of the static fields and the identity document
_GENERATION_AT: Final = 72
_TARGET_T1_AT: Final = 80
_OUTCOME_AT: Final = 128
_OUTCOME_END: Final = 512
_IDENTITY_AT: Final = 1024
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_OUTCOME_HEAD = struct.Struct("<II")  # CRC-32, length of the JSON that follows

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
_I64_MAX: Final = (1 << 63) - 1
assert _RECORD.size == RECORD_BYTES and _STATIC.size + 8 <= _GENERATION_AT

IdentityValue = str | int | float | bool | None
Identity = Mapping[str, IdentityValue]


class IndexError_(RegionError):
    """Base of the index's own errors (not builtins.IndexError)."""


class IndexUnavailable(IndexError_):
    """The index cannot be used by this engine (busy, no space, not a regular file): it starts
    cold and says why; the engine itself runs on."""


class InvalidIdentity(IndexError_, ValueError):
    """An identity the index cannot hold: a value of another type, or too long a document."""


def index_size(records: int) -> int:
    """Bytes of an index of `records` chunk slots: the header and a record a slot, rounded up to
    a page."""
    raw = HEADER_BYTES + records * RECORD_BYTES
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def flat_json_object(document: bytes) -> dict[str, Any]:
    """The JSON object of scalars a tenant's bytes hold (an identity, an outcome). Nesting is
    refused before json reads it (json recurses once a level: a deep array is a RecursionError),
    and what json can raise on other bytes is a ValueError here."""
    outside_strings = _JSON_STRING.sub(b'""', document).strip()
    if not (outside_strings.startswith(b"{") and outside_strings.endswith(b"}")):
        raise ValueError("not a JSON object")
    if any(outside_strings.count(bracket) for bracket in (b"[", b"]")) or (
        outside_strings.count(b"{"),
        outside_strings.count(b"}"),
    ) != (1, 1):
        raise ValueError("a nested value: only strings, numbers, booleans and null")
    try:
        value = json.loads(document)
    except (ValueError, RecursionError) as exc:  # RecursionError: belt and braces
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def identity_document(identity: Identity) -> bytes:
    """The canonical JSON of an identity (sorted keys, no spaces): what the header stores and
    digests. Values are JSON scalars; the document fits the header."""
    for name, value in identity.items():
        if not isinstance(name, str) or not name:
            raise InvalidIdentity(f"identity field names are non-empty strings, got {name!r}")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise InvalidIdentity(
                f"identity field {name!r} must be a string, number, boolean or null, "
                f"got {type(value).__name__}"
            )
    document = json.dumps(dict(identity), sort_keys=True, separators=(",", ":")).encode()
    if len(document) > MAX_IDENTITY_BYTES:
        raise InvalidIdentity(
            f"the identity document is {len(document)} bytes; the index holds at most "
            f"{MAX_IDENTITY_BYTES}: digest long values"
        )
    return document


@dataclass(frozen=True)
class FieldDifference:
    """One identity field that differs between the index and the engine."""

    field: str
    indexed: IdentityValue
    engine: IdentityValue

    def describe(self, width: int = 96) -> str:
        def shown(value: IdentityValue) -> str:
            text = json.dumps(value)
            return text if len(text) <= width else text[: width - 3] + "..."

        return f"{self.field} (index: {shown(self.indexed)}, engine: {shown(self.engine)})"


def identity_differences(indexed: Identity, engine: Identity) -> list[FieldDifference]:
    """Every field whose value differs, a field missing on one side included, sorted by name."""
    found = []
    for name in sorted(set(indexed) | set(engine)):
        old, new = indexed.get(name), engine.get(name)
        # a bool is an int to Python, but true is no 1 to an identity
        if name not in indexed or name not in engine or old != new or type(old) is not type(new):
            found.append(FieldDifference(name, old, new))
    return found


@dataclass(frozen=True)
class Outcome:
    """What the engine made of the index at its start, for the agent's status: warm (with how
    many chunks) or cold (and why)."""

    state: str  # "warm" or "cold"
    reason: str = ""
    chunks: int = 0
    at: float = 0.0

    def encode(self) -> bytes:
        room = _OUTCOME_END - _OUTCOME_AT - _OUTCOME_HEAD.size
        reason = self.reason
        while True:
            body = json.dumps(
                {"state": self.state, "reason": reason, "chunks": self.chunks, "at": self.at},
                sort_keys=True,
                separators=(",", ":"),
            ).encode()
            if len(body) <= room:
                return _OUTCOME_HEAD.pack(zlib.crc32(body), len(body)) + body
            reason = reason[: max(0, len(reason) - (len(body) - room) - 3)] + "..."

    @classmethod
    def decode(cls, block: bytes) -> Outcome | None:
        """The outcome in a header's outcome block, or None when there is none, it is torn, or
        it holds what no engine writes (a tenant's: anything at all)."""
        crc, length = _OUTCOME_HEAD.unpack_from(block)
        body = block[_OUTCOME_HEAD.size : _OUTCOME_HEAD.size + length]
        if not 0 < length <= len(block) - _OUTCOME_HEAD.size or zlib.crc32(body) != crc:
            return None
        try:
            data = flat_json_object(body)
            state, reason, chunks, at = data["state"], data["reason"], data["chunks"], data["at"]
        except (ValueError, KeyError):
            return None
        if not (
            state in ("warm", "cold")
            and type(reason) is str
            and type(chunks) is int  # a bool is an int to Python, not to the status
            and 0 <= chunks <= _I64_MAX
            and type(at) in (int, float)
        ):
            return None
        try:
            seconds = float(at)
        except OverflowError:  # an integer past the largest float
            return None
        return cls(state, reason, chunks, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True)
class IndexHeader:
    """A header read and checked: its identity is present only if every check passed."""

    records: int
    identity: Mapping[str, IdentityValue] | None
    problem: str | None
    """Why the header cannot be used (None: it can)."""
    generation: int
    target_t1: float
    outcome: Outcome | None


def parse_header(data: bytes, records: int | None = None) -> IndexHeader:
    """Check a header's bytes (at least HEADER_BYTES); `records`, if given, is what the engine
    expects. Never raises on bad bytes: the problem says what is wrong."""
    if len(data) < HEADER_BYTES:
        return IndexHeader(
            0, None, f"the file is {len(data)} bytes, shorter than a header", 0, 0, None
        )
    magic, version, header_bytes, record_bytes, identity_len, count, digest = _STATIC.unpack_from(
        data
    )
    generation = _U64.unpack_from(data, _GENERATION_AT)[0]
    target_t1 = _F64.unpack_from(data, _TARGET_T1_AT)[0]
    outcome = Outcome.decode(data[_OUTCOME_AT:_OUTCOME_END])

    def bad(problem: str) -> IndexHeader:
        return IndexHeader(count, None, problem, generation, target_t1, outcome)

    if not any(data[:HEADER_BYTES]):
        return bad("a new index: no engine wrote it yet")
    if magic != MAGIC:
        return bad("it is not a kvshm index (no magic): overwritten")
    if version != FORMAT_VERSION:
        return bad(f"index format {version}, this kvshm writes {FORMAT_VERSION}")
    if (header_bytes, record_bytes) != (HEADER_BYTES, RECORD_BYTES):
        return bad(f"header/record sizes {header_bytes}/{record_bytes}, expected 4096/80")
    if not 0 < identity_len <= MAX_IDENTITY_BYTES:
        return bad(f"an identity of {identity_len} bytes (at most {MAX_IDENTITY_BYTES})")
    if not 0 < count <= MAX_RECORDS:
        return bad(f"{count} records")
    document = data[_IDENTITY_AT : _IDENTITY_AT + identity_len]
    check = zlib.crc32(document, zlib.crc32(data[:_STATIC_CHECK_AT]))
    if _U32.unpack_from(data, _STATIC_CHECK_AT)[0] != check:
        return bad("the header's checksum does not match (a torn or altered header)")
    if hashlib.sha256(document).digest() != digest:
        return bad("the identity's digest does not match")
    try:
        identity = flat_json_object(document)
        identity_document(identity)  # the same rules as when it was written
    except (ValueError, InvalidIdentity) as exc:
        return bad(f"the identity is unreadable ({exc})")
    if records is not None and count != records:
        return bad(f"the index has {count} records, the region {records} chunks")
    return IndexHeader(count, identity, None, generation, target_t1, outcome)


@dataclass(frozen=True)
class IndexReading:
    """What a reader other than the engine (the agent, for the region's status) finds of a
    region's index: nothing, the outcome of the last engine's start, or why it has none."""

    present: bool
    outcome: Outcome | None = None
    problem: str = ""  # why there is no outcome (present, outcome None)


def read_outcome(dir_fd: int, instance_id: str, directory: str) -> IndexReading:
    """The outcome block of the index of region `instance_id` in the directory open as
    `dir_fd` (`directory` only names it in messages): one pread of the header, never a mapping
    (the tenant could truncate it under a reader: SIGBUS), never a lock (the engine holds it),
    never a symlink, FIFO or hard-linked file (safefile). Never raises on what the file holds."""
    name = index_file_name(instance_id)
    path = os.path.join(directory, name)
    try:
        fd = safefile.open_checked(name, os.O_RDONLY, path, dir_fd)
    except FileNotFoundError:
        return IndexReading(False)
    except UnsafePathError as exc:
        return IndexReading(True, None, str(exc))
    except OSError as exc:
        return IndexReading(True, None, f"{path} cannot be opened ({exc.strerror})")
    try:
        data = os.pread(fd, HEADER_BYTES, 0)
    except OSError as exc:
        return IndexReading(True, None, f"{path} cannot be read ({exc.strerror})")
    finally:
        os.close(fd)
    header = parse_header(data)
    if header.outcome is not None:
        return IndexReading(True, header.outcome)
    return IndexReading(
        True,
        None,
        header.problem
        or "it holds no engine's outcome (an engine is starting, or the header was altered)",
    )


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
    return min(max(int(value), _I64_MIN), _I64_MAX)


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
        self._generation = _U64.unpack_from(mapping, _GENERATION_AT)[0]

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
        _F64.pack_into(mapping, _TARGET_T1_AT, 0.0)
        mapping[_IDENTITY_AT:HEADER_BYTES] = bytes(HEADER_BYTES - _IDENTITY_AT)
        mapping[_IDENTITY_AT : _IDENTITY_AT + len(document)] = document
        _STATIC.pack_into(
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
        check = zlib.crc32(document, zlib.crc32(mapping[:_STATIC_CHECK_AT]))
        _U32.pack_into(mapping, _STATIC_CHECK_AT, check)

    def _set_generation(self, generation: int) -> None:
        _U64.pack_into(self._mapping, _GENERATION_AT, generation)
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
        self.invalidate_many(invalid)  # R4: a slot that enters the free list is invalid
        records = list(by_key.values())
        records.sort(key=_eviction_order)
        return records, discarded

    # -- records -------------------------------------------------------------------------

    def commit(self, slot: int, key: bytes, order: tuple[int, int]) -> None:
        """Record that chunk `slot` holds the complete bytes of `key` (R1): the body first, the
        commit word last."""
        self.commit_many(((slot, key, order),))

    def commit_many(self, records: Iterable[tuple[int, bytes, tuple[int, int]]]) -> None:
        """commit() for many (slot, key, order) at once (a completed store job's chunks)."""
        generation = self._generation
        mixed = generation ^ (generation >> 32)
        mapping = self._mapping
        body, word, crc32 = _BODY.pack_into, _U64.pack_into, zlib.crc32
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
        """Chunk `slot` no longer holds its key's bytes, or soon will not (R2, R4)."""
        _U64.pack_into(self._mapping, HEADER_BYTES + slot * RECORD_BYTES, 0)

    def invalidate_many(self, slots: Iterable[int]) -> None:
        mapping, word = self._mapping, _U64.pack_into
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
        """Invalidate every record at once (R3: vLLM's reset_cache)."""
        self._set_generation(_new_generation(self._generation))

    @property
    def target_t1(self) -> float:
        value: float = _F64.unpack_from(self._mapping, _TARGET_T1_AT)[0]
        return value

    @target_t1.setter
    def target_t1(self, value: float) -> None:
        _F64.pack_into(self._mapping, _TARGET_T1_AT, float(value))

    def write_outcome(self, outcome: Outcome) -> None:
        block = outcome.encode()
        mapping = self._mapping
        mapping[_OUTCOME_AT:_OUTCOME_END] = block + bytes(_OUTCOME_END - _OUTCOME_AT - len(block))

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


def now() -> float:
    """The time an outcome carries."""
    return time.time()
