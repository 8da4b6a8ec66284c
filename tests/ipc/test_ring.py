from __future__ import annotations

import gc
import os
import pickle
import stat
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvshm.ipc import (
    ReaderDiedError,
    ReaderEvictedError,
    RingFormatError,
    RingReader,
    RingTimeout,
    RingWriter,
    RoleBusyError,
    ShmRingBuffer,
    WriterDiedError,
)
from kvshm.ipc.layout import LINE
from tests.ipc.procs import QUICK
from tests.ipc.tenant import scribbling_on


def send(writer: RingWriter, data: bytes, timeout: float | None = 1.0) -> None:
    chunk = writer.acquire(timeout)
    chunk[: len(data)] = data
    writer.publish()


def receive(reader: RingReader, size: int, timeout: float | None = 1.0) -> bytes:
    chunk = reader.acquire(timeout)
    data = bytes(chunk[:size])
    reader.release()
    return data


def test_default_ring_lives_in_dev_shm_owner_only_and_its_creator_removes_it() -> None:
    ring = ShmRingBuffer(2, 1024, 4)
    path = ring.path
    try:
        assert path.startswith("/dev/shm/kvshm_ring_")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert ring.is_creator
        other = pickle.loads(pickle.dumps(ring))
        assert not other.is_creator and other.path == path
        other.close()
        assert os.path.exists(path)  # a non-creator never removes it
    finally:
        ring.close()
    assert not os.path.exists(path)
    ring.close()  # idempotent


def test_the_handle_pickle_is_small_and_attaches_to_the_same_memory(ring_dir: str) -> None:
    with ShmRingBuffer(3, 4096, 8, directory=ring_dir) as ring:
        blob = pickle.dumps(ring)
        assert len(blob) < 300
        with pickle.loads(blob) as other:
            ring.get_data(5)[:5] = b"hello"
            assert bytes(other.get_data(5)[:5]) == b"hello"
            assert other.handle() == ring.handle()


def test_data_and_flags_sit_where_semantics_puts_them(ring_dir: str) -> None:
    with ShmRingBuffer(2, 1000, 3, directory=ring_dir) as ring:
        ring.get_data(2)[:3] = b"abc"
        ring.get_metadata(1)[:] = b"\x01\x00\x01"
        raw = Path(ring.path).read_bytes()
        assert raw[2000:2003] == b"abc"
        assert raw[3000 + 3 : 3000 + 6] == b"\x01\x00\x01"


def test_attach_by_path_reads_the_geometry(ring_dir: str) -> None:
    with (
        ShmRingBuffer(4, 2048, 5, "events", directory=ring_dir, create=True) as ring,
        ShmRingBuffer.attach(ring.path) as other,
    ):
        assert (other.n_reader, other.max_chunk_bytes, other.max_chunks) == (4, 2048, 5)


def test_attach_by_name_with_another_geometry_is_refused(ring_dir: str) -> None:
    with (
        ShmRingBuffer(4, 2048, 5, "events", directory=ring_dir, create=True),
        pytest.raises(RingFormatError, match="has 4 readers, 5 chunks of 2048 bytes"),
    ):
        ShmRingBuffer(2, 2048, 5, "events", directory=ring_dir)


def test_attach_to_a_missing_ring_times_out_clearly(ring_dir: str) -> None:
    with pytest.raises(RingTimeout, match="did not appear"):
        ShmRingBuffer.attach(os.path.join(ring_dir, "nothing"), attach_timeout=0.05)


def test_attach_waits_for_the_creator_to_finish(ring_dir: str) -> None:
    with ShmRingBuffer(1, 1024, 2, "real", directory=ring_dir, create=True) as ring:
        image = Path(ring.path).read_bytes()
    half_made = Path(ring_dir) / "events"
    half_made.write_bytes(image[:-LINE] + bytes(LINE))  # sized, trailer not yet written
    half_made.chmod(0o600)
    threading.Timer(0.1, lambda: half_made.write_bytes(image)).start()
    started = time.monotonic()
    with ShmRingBuffer.attach(str(half_made), attach_timeout=5) as other:
        assert time.monotonic() - started >= 0.09
        assert other.max_chunks == 2
    half_made.unlink()


def test_written_and_read_flags_follow_the_protocol(ring_dir: str) -> None:
    with ShmRingBuffer(3, 256, 4, directory=ring_dir) as ring:
        writer = RingWriter(ring, QUICK)
        readers = [RingReader(ring, rank, QUICK) for rank in (0, 1)]  # slot 2 stays empty
        assert writer.joined_readers() == [0, 1]
        chunk = writer.acquire()
        assert ring.get_metadata(0)[0] == 0  # cleared before filling
        chunk[:4] = b"ping"
        writer.publish()
        assert bytes(ring.get_metadata(0)) == b"\x01\x00\x00\x01"  # written; empty slot 2 read
        assert receive(readers[1], 4) == b"ping"
        assert bytes(ring.get_metadata(0)) == b"\x01\x00\x01\x01"
        assert receive(readers[0], 4) == b"ping"
        assert bytes(ring.get_metadata(0)) == b"\x01\x01\x01\x01"
        for role in (*readers, writer):
            role.close()


def test_a_chunk_being_written_is_invisible_to_readers(ring_dir: str) -> None:
    with ShmRingBuffer(1, 256, 4, directory=ring_dir) as ring:
        writer, reader = RingWriter(ring, QUICK), RingReader(ring, 0, QUICK)
        writer.joined_readers()
        send(writer, b"one")
        chunk = writer.acquire()
        chunk[:3] = b"hal"  # half-written, never published
        assert receive(reader, 3) == b"one"
        with pytest.raises(RingTimeout):
            reader.acquire(timeout=0.05)
        writer.publish()
        assert receive(reader, 3) == b"hal"
        writer.close()
        reader.close()


def test_a_reader_receives_what_is_sent_after_it_joined(ring_dir: str) -> None:
    with ShmRingBuffer(2, 256, 4, directory=ring_dir) as ring:
        writer = RingWriter(ring, QUICK)
        early = RingReader(ring, 0, QUICK)
        send(writer, b"first")
        late = RingReader(ring, 1, QUICK)
        send(writer, b"secnd")
        assert receive(early, 5) == b"first"
        assert receive(early, 5) == b"secnd"
        assert receive(late, 5) == b"secnd"
        with pytest.raises(RingTimeout):
            late.acquire(timeout=0.05)
        for role in (early, late, writer):
            role.close()


def test_roles_are_exclusive(ring_dir: str) -> None:
    with ShmRingBuffer(2, 256, 4, directory=ring_dir) as ring:
        writer = RingWriter(ring, QUICK)
        with pytest.raises(RoleBusyError, match="already has a writer"):
            RingWriter(ring, QUICK)
        first = RingReader(ring, None, QUICK)
        assert first.rank == 0
        with pytest.raises(RoleBusyError, match=r"slot 0 .* is held by a live reader"):
            RingReader(ring, 0, QUICK)
        second = RingReader(ring, None, QUICK)
        assert second.rank == 1
        with pytest.raises(RoleBusyError, match="all 2 reader slots"):
            RingReader(ring, None, QUICK)
        second.close()
        third = RingReader(ring, None, QUICK)  # a freed slot can be taken again
        assert third.rank == 1
        for role in (first, third, writer):
            role.close()


def test_a_forgotten_role_frees_its_slot_when_collected(ring_dir: str) -> None:
    with ShmRingBuffer(1, 256, 2, directory=ring_dir) as ring:
        RingReader(ring, 0, QUICK)  # dropped at once
        RingWriter(ring, QUICK)
        gc.collect()
        RingReader(ring, 0, QUICK).close()
        RingWriter(ring, QUICK).close()


def fill(writer: RingWriter, count: int) -> None:
    for index in range(count):
        send(writer, bytes([index]))


@contextmanager
def joined(
    ring_dir: str, n_reader: int, chunks: int = 2, **writer_options: Any
) -> Iterator[tuple[RingWriter, list[RingReader]]]:
    """A writer and n_reader readers, all joined; every role closed on the way out."""
    with ShmRingBuffer(n_reader, 256, chunks, directory=ring_dir) as ring:
        writer = RingWriter(ring, QUICK, **writer_options)
        readers = [RingReader(ring, rank, QUICK) for rank in range(n_reader)]
        writer.wait_until_ready(timeout=1)
        try:
            yield writer, readers
        finally:
            for role in (*readers, writer):
                role.close()


def die(role: RingReader | RingWriter) -> None:
    """What the kernel does when a role's process dies: its lock goes, nothing else."""
    role._release_role()


def test_a_reader_that_leaves_stops_blocking_the_writer(ring_dir: str) -> None:
    with joined(ring_dir, 2) as (writer, (active, leaving)):
        fill(writer, 2)
        assert receive(active, 1) == b"\x00"
        with pytest.raises(RingTimeout, match=r"waiting for readers \[1\]"):
            send(writer, b"x", timeout=0.05)
        leaving.close()
        send(writer, b"\x02")
        assert [receive(active, 1) for _ in range(2)] == [b"\x01", b"\x02"]


def test_a_dead_reader_fails_the_writer_with_its_name(ring_dir: str) -> None:
    with joined(ring_dir, 2) as (writer, (alive, doomed)):
        fill(writer, 2)
        receive(alive, 1)
        die(doomed)
        started = time.monotonic()
        with pytest.raises(ReaderDiedError, match=rf"reader 1 of ring .*pid {os.getpid()}") as err:
            send(writer, b"x", timeout=5)
        assert err.value.rank == 1
        assert QUICK.peer_death_grace_seconds <= time.monotonic() - started < 2
        assert "evict_reader(1)" in str(err.value) and "rank=1" in str(err.value)
        writer.evict_reader(1)
        send(writer, b"\x02")
        assert [receive(alive, 1) for _ in range(2)] == [b"\x01", b"\x02"]


def test_a_replacement_rejoins_the_dead_readers_slot(ring_dir: str) -> None:
    with joined(ring_dir, 1) as (writer, (doomed,)):
        fill(writer, 2)
        die(doomed)
        replacement = RingReader(doomed._ring, 0, QUICK)
        send(writer, b"after", timeout=1)  # the join unblocks the writer
        assert receive(replacement, 5) == b"after"  # the dead one's backlog is not replayed
        replacement.close()


def test_the_writer_can_evict_dead_readers_by_itself(ring_dir: str) -> None:
    with joined(ring_dir, 1, on_dead_reader="evict") as (writer, (doomed,)):
        fill(writer, 2)
        die(doomed)
        send(writer, b"x", timeout=2)
        assert writer.joined_readers() == []


def test_an_evicted_reader_is_told_so(ring_dir: str) -> None:
    with joined(ring_dir, 1) as (writer, (reader,)):
        writer.evict_reader(0)
        send(writer, b"x")
        with pytest.raises(ReaderEvictedError, match="evicted reader 0"):
            reader.acquire(timeout=2)


def test_readers_learn_that_the_writer_died(ring_dir: str) -> None:
    with joined(ring_dir, 1) as (writer, (reader,)):
        send(writer, b"last")
        die(writer)
        assert receive(reader, 4) == b"last"  # finished messages are still delivered
        with pytest.raises(WriterDiedError, match=f"pid {os.getpid()}"):
            reader.acquire(timeout=5)


def test_a_restarted_writer_continues_where_the_old_one_stopped(ring_dir: str) -> None:
    with joined(ring_dir, 1, chunks=3) as (old, (reader,)):
        fill(old, 2)
        assert receive(reader, 1) == b"\x00"
        die(old)
        new = RingWriter(reader._ring, QUICK)
        send(new, b"\x02")
        send(new, b"\x03")  # wraps around into the chunk the reader has read
        assert [receive(reader, 1) for _ in range(3)] == [b"\x01", b"\x02", b"\x03"]
        new.close()


def test_a_scribbled_start_is_a_format_error_and_the_reader_joins_again(
    shm_ring_dir: str,
) -> None:
    with ShmRingBuffer(1, 256, 4, directory=shm_ring_dir) as ring:
        writer = RingWriter(ring, QUICK)
        reader = RingReader(ring, 0, QUICK)
        writer.joined_readers()  # the writer carries the join out: start = chunk 0
        with scribbling_on(ring.path) as mapping:
            struct.pack_into("<I", mapping, ring.layout.reader_slot_offset(0) + 4, 1000)
        with pytest.raises(RingFormatError, match="start at chunk 1000, but the ring has 4"):
            reader.acquire(timeout=1)
        send(writer, b"after")  # carries out the join the reader asked for again
        assert receive(reader, 5) == b"after"
        reader.close()
        writer.close()


def test_evict_mode_evicts_a_dead_reader_even_if_every_send_times_out_sooner(
    shm_ring_dir: str,
) -> None:
    grace = QUICK.peer_death_grace_seconds
    with joined(shm_ring_dir, 2, on_dead_reader="evict") as (writer, (alive, doomed)):
        fill(writer, 2)
        receive(alive, 1)
        die(doomed)
        started = time.monotonic()
        while True:
            try:
                send(writer, b"x", timeout=grace / 4)
                break
            except RingTimeout:
                assert time.monotonic() - started < 10 * grace, "the dead reader was never evicted"
        assert writer.joined_readers() == [0]
        assert time.monotonic() - started >= grace


def test_a_writer_that_died_inside_publish_is_resumed_in_order(shm_ring_dir: str) -> None:
    with joined(shm_ring_dir, 1, chunks=4) as (old, (reader,)):
        send(old, b"A")
        # a crash after publish() set chunk 0's written flag, before it stored the cursor
        old._ring.registry.writer_cursor[0] = 0
        die(old)
        assert receive(reader, 1) == b"A"
        new = RingWriter(reader._ring, QUICK)
        got = []
        for message in (b"B", b"C", b"D", b"E", b"F"):
            send(new, message)
            got.append(receive(reader, 1))
        assert got == [b"B", b"C", b"D", b"E", b"F"]
        new.close()
