"""The warm-restart index's file format, as any reader checks it: the header's layout, the
identity document and how two identities differ, the outcome block, and parse_header.

docs/warm-restart.md ("Format") is the layout in a table. The records' layout and the commit
protocol are the writer's (kvshm.region.index.writer); the agent reads through
kvshm.region.index.reader. Pure Python (struct, zlib, json): the agent imports it, and no
numpy. The file is the tenant's, so nothing read from it is trusted: every size is checked
before use, and a bad header is a problem to report, never an exception.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import re
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvshm.region.errors import RegionError

MAGIC: Final = b"KVSHMIDX"
FORMAT_VERSION: Final = 1
HEADER_BYTES: Final = 4096
RECORD_BYTES: Final = 80
MAX_KEY_BYTES: Final = 48  # vLLM 0.33's OffloadKey: a 32-byte sha256 block hash + 4 group bytes
MAX_IDENTITY_BYTES: Final = 3072
MAX_RECORDS: Final = 1 << 32  # a bound on a tenant's header, far above any region's chunks

# header: magic, version, header bytes, record bytes, identity bytes, records, identity digest
STATIC = struct.Struct("<8sIIII Q 32s")
STATIC_CHECK_AT: Final = 64  # CRC-32 of the static fields and the identity document
GENERATION_AT: Final = 72
TARGET_T1_AT: Final = 80
OUTCOME_AT: Final = 128
OUTCOME_END: Final = 512
IDENTITY_AT: Final = 1024
UINT32 = struct.Struct("<I")
UINT64 = struct.Struct("<Q")
FLOAT64 = struct.Struct("<d")
_OUTCOME_HEAD = struct.Struct("<II")  # CRC-32, length of the JSON that follows

I64_MAX: Final = (1 << 63) - 1
assert STATIC.size + 8 <= GENERATION_AT

IdentityValue = str | int | float | bool | None
Identity = Mapping[str, IdentityValue]


class IndexError_(RegionError):
    """Base of the index's own errors (not builtins.IndexError)."""


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
        room = OUTCOME_END - OUTCOME_AT - _OUTCOME_HEAD.size
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
            and 0 <= chunks <= I64_MAX
            and type(at) in (int, float)
        ):
            return None
        try:
            seconds = float(at)
        except OverflowError:  # an integer past the largest float
            return None
        return cls(state, reason, chunks, seconds) if math.isfinite(seconds) else None


def now() -> float:
    """The time an outcome carries."""
    return time.time()


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
    magic, version, header_bytes, record_bytes, identity_len, count, digest = STATIC.unpack_from(
        data
    )
    generation = UINT64.unpack_from(data, GENERATION_AT)[0]
    target_t1 = FLOAT64.unpack_from(data, TARGET_T1_AT)[0]
    outcome = Outcome.decode(data[OUTCOME_AT:OUTCOME_END])

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
    document = data[IDENTITY_AT : IDENTITY_AT + identity_len]
    check = zlib.crc32(document, zlib.crc32(data[:STATIC_CHECK_AT]))
    if UINT32.unpack_from(data, STATIC_CHECK_AT)[0] != check:
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
