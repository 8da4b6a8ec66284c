"""Index headers as a hostile tenant writes them: any identity bytes and any outcome bytes, with
the CRC-32 and SHA-256 a tenant can compute itself, so every check but the parser's own passes.

`planted_headers()` is the fuzzer's corpus: each case named, hand-made cases first (deep
nesting, numbers past a float or an int64, booleans for integers, lone surrogates, terminal
escapes, wrong types), then seeded random mutations of a sound header with its checks redone.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import zlib
from collections.abc import Iterator

from kvshm.region.index.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_IDENTITY_BYTES,
    RECORD_BYTES,
    Outcome,
)

# the header's layout (docs/warm-restart.md, "The file"): a tenant reads it there too
_STATIC = struct.Struct("<8sIIII Q 32s")
_CHECK_AT = 64
_GENERATION_AT = 72
_OUTCOME_AT = 128
_OUTCOME_END = 512
_IDENTITY_AT = 1024
OUTCOME_ROOM = _OUTCOME_END - _OUTCOME_AT - 8


def header(
    identity: bytes = b'{"model":"m"}',
    outcome: bytes | None = None,
    records: int = 16,
    generation: int = 0x1234_5678_9ABC_DEF0,
) -> bytes:
    """A header whose checks all pass for whatever `identity` and `outcome` bytes it holds."""
    data = bytearray(HEADER_BYTES)
    identity = identity[:MAX_IDENTITY_BYTES]
    data[_IDENTITY_AT : _IDENTITY_AT + len(identity)] = identity
    _STATIC.pack_into(
        data,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        RECORD_BYTES,
        len(identity),
        records,
        hashlib.sha256(identity).digest(),
    )
    struct.pack_into("<I", data, _CHECK_AT, zlib.crc32(identity, zlib.crc32(data[:_CHECK_AT])))
    struct.pack_into("<Q", data, _GENERATION_AT, generation)
    if outcome is not None:
        block = outcome_block(outcome)
        data[_OUTCOME_AT : _OUTCOME_AT + len(block)] = block
    return bytes(data)


def outcome_block(body: bytes) -> bytes:
    """An outcome block for any body (cut to the room it has), its CRC-32 right."""
    body = body[:OUTCOME_ROOM]
    return struct.pack("<II", zlib.crc32(body), len(body)) + body


def outcome_json(**fields: object) -> bytes:
    sound: dict[str, object] = {"state": "warm", "reason": "", "chunks": 3, "at": 1.7e9}
    return json.dumps({**sound, **fields}, separators=(",", ":")).encode()


def _deep(opening: bytes, closing: bytes, depth: int) -> bytes:
    return opening * depth + closing * depth


def _hand_made() -> Iterator[tuple[str, bytes]]:
    sound_outcome = outcome_json()
    for depth in (2, 100, 1500, MAX_IDENTITY_BYTES // 2):
        yield f"identity: an array {depth} deep", header(_deep(b"[", b"]", depth), sound_outcome)
        nested = b'{"a":' * depth + b"1" + b"}" * depth
        yield f"identity: objects {depth} deep", header(nested, sound_outcome)
        value = b'{"a":' + _deep(b"[", b"]", depth) + b"}"
        yield f"identity: a value nested {depth} deep", header(value, sound_outcome)
    for text, what in (
        (b'{"a":' + b"9" * 3000 + b"}", "an integer of 3000 digits"),
        (b'{"a":1e999}', "a float past the largest"),
        (b'{"a":NaN,"b":Infinity,"c":-Infinity}', "NaN and infinities"),
        (b'{"a":"\\ud800"}', "a lone surrogate"),
        (b'{"a":"\x1b[2J\x07"}', "raw terminal escapes"),
        (b'{"a":"\xff\xfe"}', "bytes that are not UTF-8"),
        (b'{"a":1,"a":"x"}', "a repeated name"),
        (b'{"":1}', "an empty name"),
        (b'"just a string"', "a string"),
        (b"[]", "an empty array"),
        (b"null", "null"),
        (b"{", "an unclosed object"),
        (b'{"a":"x}', "an unclosed string"),
        (b'{"a":"\\"}', "an escaped closing quote"),
        (b" " * 3000 + b"{}", "whitespace"),
        (b"\0" * 64, "zero bytes"),
    ):
        yield f"identity: {what}", header(text, sound_outcome)
    # the outcome block: the agent reads it every pass
    for field, value in (
        ("at", 10**320),
        ("at", -(10**320)),
        ("at", float("inf")),
        ("at", float("nan")),
        ("at", True),
        ("at", "yesterday"),
        ("at", None),
        ("chunks", True),
        ("chunks", -1),
        ("chunks", 1 << 64),
        ("chunks", 10**300),
        ("chunks", 3.5),
        ("chunks", "3"),
        ("state", "Warm"),
        ("state", 1),
        ("reason", "\ud800\udfff\ud800 \x1b]0;owned\x07 \u202e"),
        ("reason", "x" * 1000),
        ("reason", 7),
    ):
        yield f"outcome: {field}={str(value)[:24]}", header(outcome=outcome_json(**{field: value}))
    for raw, what in (
        (b'{"state":"warm","reason":"","chunks":1,"at":' + b"9" * 400 + b"}", "a cut number"),
        (_deep(b"[", b"]", OUTCOME_ROOM // 2), "an array as deep as the block allows"),
        (b'{"state":' + _deep(b"[", b"]", 180) + b"}", "a nested state"),
        (b"\xff" * OUTCOME_ROOM, "bytes that are not UTF-8"),
        (b'{"state":"warm"}', "missing fields"),
        (b"[]", "an array"),
    ):
        yield f"outcome: {what}", header(outcome=raw)
    yield "header: a record count of 0", header(records=0)
    yield "header: the largest record count", header(records=(1 << 64) - 1)


def _mutations(seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    """A sound header's identity and outcome bytes flipped, cut, repeated and spliced with JSON's
    own punctuation, then checked again as a tenant would."""
    rng = random.Random(seed)
    punctuation = [b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"1e999", b"-", b"9" * 40]
    identity = json.dumps({"model": "m", "block_size": 16, "dtype": "bfloat16", "tp": 1}).encode()
    outcome = outcome_json(reason="it was written for another identity")
    for case in range(count):
        chosen = bytearray(rng.choice((identity, outcome)))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(chosen) + 1)
            move = rng.randrange(4)
            if move == 0 and chosen:
                chosen[at % len(chosen)] = rng.randrange(256)
            elif move == 1:
                chosen[at:at] = rng.choice(punctuation) * rng.randint(1, 300)
            elif move == 2:
                del chosen[at : at + rng.randint(1, 20)]
            else:
                chosen[at:at] = chosen[: rng.randint(0, len(chosen))]
        body = bytes(chosen)
        if rng.random() < 0.5:
            yield f"mutation {seed}/{case} of the identity", header(body, outcome)
        else:
            yield f"mutation {seed}/{case} of the outcome", header(outcome=body)


def planted_headers(mutations: int = 400, seed: int = 20261207) -> list[tuple[str, bytes]]:
    return [*_hand_made(), *_mutations(seed, mutations)]


def sound_header() -> bytes:
    """A header an engine would write (an outcome it decodes), for tests to vary."""
    data = header(outcome=outcome_json())
    assert Outcome.decode(data[_OUTCOME_AT:_OUTCOME_END]) is not None
    return data
