from __future__ import annotations

import pytest

from kvshm.ipc.errors import RingConfigError, RingFormatError
from kvshm.ipc.layout import LINE, MAGIC, RingLayout


def test_data_then_one_written_flag_and_n_read_flags_per_chunk() -> None:
    layout = RingLayout(n_reader=3, max_chunk_bytes=100, max_chunks=5)
    assert layout.data_offset == 0
    assert [layout.chunk_offset(i) for i in range(5)] == [0, 100, 200, 300, 400]
    assert layout.metadata_offset == 500
    assert layout.flags_per_chunk == 4
    assert [layout.flags_offset(i) for i in range(5)] == [500, 504, 508, 512, 516]


def test_registry_follows_the_metadata_on_its_own_lines() -> None:
    layout = RingLayout(n_reader=3, max_chunk_bytes=100, max_chunks=5)
    metadata_end = layout.metadata_offset + 5 * 4
    assert layout.requests_offset >= metadata_end
    assert layout.requests_offset % LINE == 0
    offsets = [
        layout.requests_offset,
        layout.kinds_offset,
        layout.acks_offset,
        layout.active_offset,
        layout.wake_offset,
        layout.sleepers_offset,
        *(layout.reader_slot_offset(rank) for rank in range(3)),
        layout.writer_slot_offset,
        layout.trailer_offset,
        layout.total_bytes,
    ]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert all(offset % LINE == 0 for offset in offsets)
    assert layout.total_bytes - layout.trailer_offset == LINE


def test_trailer_names_the_geometry() -> None:
    layout = RingLayout(n_reader=4, max_chunk_bytes=4096, max_chunks=7)
    trailer = layout.trailer()
    assert len(trailer) == LINE and trailer.startswith(MAGIC)
    assert RingLayout.from_trailer(trailer, layout.total_bytes, "x") == layout


def test_a_zero_trailer_means_not_finished_yet() -> None:
    assert RingLayout.from_trailer(bytes(LINE), 12345, "x") is None


@pytest.mark.parametrize(
    ("trailer", "size_delta", "message"),
    [
        (b"NOTARING" + bytes(LINE - 8), 0, "not a kvshm ring"),
        (None, 64, "describes a ring of"),
    ],
)
def test_a_foreign_or_damaged_trailer_is_refused(
    trailer: bytes | None, size_delta: int, message: str
) -> None:
    layout = RingLayout(2, 1024, 3)
    with pytest.raises(RingFormatError, match=message):
        RingLayout.from_trailer(trailer or layout.trailer(), layout.total_bytes + size_delta, "x")


def test_another_format_version_is_refused_with_advice() -> None:
    layout = RingLayout(2, 1024, 3)
    trailer = bytearray(layout.trailer())
    trailer[9] = 99  # version, big-endian after the 8-byte magic
    with pytest.raises(RingFormatError, match="same kvshm version"):
        RingLayout.from_trailer(bytes(trailer), layout.total_bytes, "x")


@pytest.mark.parametrize(
    ("n_reader", "chunk_bytes", "chunks", "message"),
    [
        (0, 1024, 4, "n_reader must be a positive integer"),
        (2, 1024, 0, "max_chunks must be a positive integer"),
        (2, 16, 4, "max_chunk_bytes is 16"),
        (257, 1024, 4, "at most 256 readers"),
        (True, 1024, 4, "n_reader must be a positive integer"),
    ],
)
def test_impossible_geometries_are_refused(
    n_reader: int, chunk_bytes: int, chunks: int, message: str
) -> None:
    with pytest.raises(RingConfigError, match=message):
        RingLayout(n_reader, chunk_bytes, chunks)
