from __future__ import annotations

import pickle
import struct
import tracemalloc

import pytest

from kvshm.ipc.codec import (
    FRAGMENT,
    OOB_THRESHOLD,
    FragmentAssembler,
    MessageEncoder,
    PieceCursor,
    decode,
)
from kvshm.ipc.errors import MessageTooLargeError, RingConfigError, RingFormatError

MIB = 1 << 20
RING = "/dev/shm/kvshm-test-ring"


def encode(obj: object, size: int = 4096) -> tuple[bool, bytearray]:
    chunk = bytearray(size)
    fits = MessageEncoder().encode_into(memoryview(chunk), obj)
    return fits, chunk


def test_a_small_message_has_the_semantics_in_chunk_format() -> None:
    obj = {"event": "region-ready", "bytes": 1 << 30}
    fits, chunk = encode(obj)
    assert fits
    expected = pickle.dumps(obj, protocol=5)
    # byte 0: no overflow; bytes 1-2: one buffer (big-endian); then its 4-byte length and bytes
    assert chunk[0] == 0
    assert chunk[1:3] == b"\x00\x01"
    assert chunk[3:7] == struct.pack(">I", len(expected))
    assert chunk[7 : 7 + len(expected)] == expected
    assert expected[:2] == b"\x80\x05"  # pickle protocol 5
    assert decode(memoryview(chunk), 1, copy_buffers=True) == obj


def test_large_pickle_buffers_go_out_of_band_and_small_ones_in_band() -> None:
    large = bytearray(b"L" * OOB_THRESHOLD)
    small = bytearray(b"s" * (OOB_THRESHOLD - 1))
    obj = [pickle.PickleBuffer(large), pickle.PickleBuffer(small), "tail"]
    fits, chunk = encode(obj, 3 * MIB)
    assert fits
    (count,) = struct.unpack_from(">H", chunk, 1)
    (pickle_bytes,) = struct.unpack_from(">I", chunk, 3)
    assert count == 2  # the pickle and the one large buffer
    assert OOB_THRESHOLD - 1 < pickle_bytes < OOB_THRESHOLD + 200  # the small one is in it
    offset = 7 + pickle_bytes
    assert struct.unpack_from(">I", chunk, offset) == (OOB_THRESHOLD,)
    assert chunk[offset + 4 : offset + 4 + OOB_THRESHOLD] == large
    got = decode(memoryview(chunk), 1, copy_buffers=True)
    chunk[offset + 4] = ord("X")  # the writer reusing the chunk must not change the message
    assert bytes(got[0]) == bytes(large) and bytes(got[1]) == bytes(small) and got[2] == "tail"


def test_a_message_too_large_for_the_chunk_does_not_fit() -> None:
    fits, _ = encode(b"x" * 5000, 4096)
    assert not fits
    fits, _ = encode([pickle.PickleBuffer(bytearray(2 * MIB))], MIB)
    assert not fits


def test_the_encoder_is_reusable_after_a_message_did_not_fit() -> None:
    encoder = MessageEncoder()
    chunk = memoryview(bytearray(256))
    assert not encoder.encode_into(chunk, ["a" * 100, "b" * 300])
    assert encoder.encode_into(chunk, ("ok", 1))
    assert decode(chunk, 1, copy_buffers=True) == ("ok", 1)


def test_shared_objects_keep_their_identity_and_memo_does_not_leak_between_messages() -> None:
    encoder = MessageEncoder()
    chunk = memoryview(bytearray(4096))
    shared = ["x"]
    assert encoder.encode_into(chunk, [shared, shared])
    first = decode(chunk, 1, copy_buffers=True)
    assert first[0] is first[1]
    assert encoder.encode_into(chunk, shared)
    assert decode(chunk, 1, copy_buffers=True) == ["x"]


def test_a_body_split_over_chunks_reassembles() -> None:
    encoder = MessageEncoder()
    obj = {"blob": bytes(range(256)) * 40, "oob": pickle.PickleBuffer(bytearray(b"o" * MIB))}
    pieces, total = encoder.encode_body(obj)
    cursor = PieceCursor(pieces)
    assembler = FragmentAssembler(RING)
    chunk_bytes = 4096
    room = chunk_bytes - FRAGMENT.size
    sent, body = 0, None
    while sent < total:
        chunk = bytearray(chunk_bytes)
        FRAGMENT.pack_into(chunk, 0, 1, 0 if sent == 0 else 1, total if sent == 0 else sent)
        take = min(room, total - sent)
        cursor.copy_into(memoryview(chunk)[FRAGMENT.size : FRAGMENT.size + take])
        sent += take
        assert body is None
        body = assembler.add(memoryview(chunk))
    assert body is not None and len(body) == total
    got = decode(body, 0, copy_buffers=False)
    assert got["blob"] == obj["blob"] and bytes(got["oob"]) == b"o" * MIB


def fragment(kind: int, value: int, payload: bytes, size: int = 64) -> memoryview:
    chunk = bytearray(size)
    FRAGMENT.pack_into(chunk, 0, 1, kind, value)
    chunk[FRAGMENT.size : FRAGMENT.size + len(payload)] = payload
    return memoryview(chunk)


def test_continuations_without_their_start_are_skipped() -> None:
    assembler = FragmentAssembler(RING)
    assert assembler.add(fragment(1, 54, b"late")) is None
    assert assembler.pending_bytes == 0


def test_a_new_message_drops_the_unfinished_one() -> None:
    assembler = FragmentAssembler(RING)
    assert assembler.add(fragment(0, 100, b"a" * 54)) is None
    assert assembler.pending_bytes == 54
    assert assembler.add(fragment(0, 10, b"b" * 10)) == b"b" * 10
    assert assembler.drop("nothing pending") == 0


def test_an_absurd_fragment_total_is_reported_not_allocated() -> None:
    with pytest.raises(RingFormatError, match="announces"):
        FragmentAssembler(RING).add(fragment(0, 1 << 62, b""))


def test_damaged_messages_are_reported_not_misread() -> None:
    chunk = bytearray(64)
    struct.pack_into(">BHI", chunk, 0, 0, 1, 1000)
    with pytest.raises(RingFormatError, match="damaged"):
        decode(memoryview(chunk), 1, copy_buffers=True)
    struct.pack_into(">BHI", chunk, 0, 0, 0, 4)
    with pytest.raises(RingFormatError, match="damaged"):
        decode(memoryview(chunk), 1, copy_buffers=True)


def test_a_buffer_count_past_the_end_of_the_body_is_reported_not_misread() -> None:
    chunk = bytearray(4096)
    # two buffers announced, but the pickle alone fills the chunk: no room for the second
    struct.pack_into(">BHI", chunk, 0, 0, 2, 4096 - 7)
    with pytest.raises(RingFormatError, match="claims 2 buffers"):
        decode(memoryview(chunk), 1, copy_buffers=True)


def test_a_first_fragment_too_short_for_a_body_is_reported() -> None:
    for announced in (0, 5):
        with pytest.raises(RingFormatError, match=f"announces {announced} bytes"):
            FragmentAssembler(RING).add(fragment(0, announced, b""))


def test_a_body_too_short_for_its_header_is_reported() -> None:
    with pytest.raises(RingFormatError, match="shorter than its 6-byte header"):
        decode(memoryview(bytearray(3)), 0, copy_buffers=False)


def test_the_body_grows_with_the_fragments_not_to_what_the_first_one_announces() -> None:
    announced = 256 * MIB
    tracemalloc.start()
    try:
        assembler = FragmentAssembler(RING)
        assert assembler.add(fragment(0, announced, b"x" * 54)) is None
        assert assembler.add(fragment(1, 54, b"y" * 54)) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert assembler.pending_bytes == 108
    assert peak < MIB, f"{peak} bytes allocated for 108 bytes received"
    assert assembler.drop("test over") == 108


def test_a_message_over_the_readers_limit_is_skipped_unread() -> None:
    assembler = FragmentAssembler(RING, max_message_bytes=100)
    with pytest.raises(MessageTooLargeError, match=f"101 bytes arrived on ring {RING}") as err:
        assembler.add(fragment(0, 101, b"x" * 54))
    assert (err.value.size, err.value.limit) == (101, 100)
    assert "max_message_bytes" in str(err.value)
    assert assembler.add(fragment(1, 54, b"x" * 47)) is None  # its rest is skipped too
    assert assembler.pending_bytes == 0
    body = MessageEncoder().encode_body("fits")
    chunk = bytearray(64)
    FRAGMENT.pack_into(chunk, 0, 1, 0, body[1])
    PieceCursor(body[0]).copy_into(memoryview(chunk)[FRAGMENT.size : FRAGMENT.size + body[1]])
    got = assembler.add(memoryview(chunk))
    assert got is not None and decode(got, 0, copy_buffers=False) == "fits"


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, (1 << 40) + 1])
def test_a_limit_that_is_not_a_size_is_refused(limit: object) -> None:
    with pytest.raises(RingConfigError, match="max_message_bytes"):
        FragmentAssembler(RING, max_message_bytes=limit)  # type: ignore[arg-type]
