from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvshm.ipc import (
    IpcError,
    MessageQueue,
    MessageTooLargeError,
    RingConfigError,
    RingFormatError,
    RingTimeout,
    WaitCancelled,
    WaitPolicy,
)
from kvshm.ipc.codec import FIRST, FRAGMENT
from tests.ipc.procs import QUICK
from tests.ipc.tenant import scribbling_on

MIB = 1 << 20


@pytest.fixture
def queue(ring_dir: str) -> Iterator[MessageQueue]:
    writer = MessageQueue(2, 256, 4, directory=ring_dir, wait_policy=QUICK)
    yield writer
    writer.close()


def readers_of(writer: MessageQueue, count: int | None = None) -> list[MessageQueue]:
    handle = writer.export_handle()
    readers = [
        MessageQueue.create_from_handle(handle, wait_policy=QUICK)
        for _ in range(count or writer.n_reader)
    ]
    assert writer.joined_readers() == [reader.rank for reader in readers]
    return readers


def in_thread(function: Callable[[], Any]) -> Callable[[], Any]:
    """Run function in a thread; the returned callable joins it and gives its result."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(function()))
    thread.start()

    def result() -> Any:
        thread.join(10)
        assert not thread.is_alive()
        return outcome[0]

    return result


def test_objects_reach_every_reader_in_order(queue: MessageQueue) -> None:
    readers = readers_of(queue)
    sent = [{"event": "region-ready", "seq": 1}, ("drain", 2.5), None, "é" * 10]
    for message in sent:
        queue.enqueue(message)
    assert [[r.dequeue(timeout=1) for _ in sent] for r in readers] == [sent, sent]
    for reader in readers:
        reader.close()


def test_broadcast_object_returns_the_object_on_both_sides(queue: MessageQueue) -> None:
    readers = readers_of(queue)
    assert queue.broadcast_object({"agent": "restarted"}) == {"agent": "restarted"}
    assert [r.broadcast_object() for r in readers] == [{"agent": "restarted"}] * 2
    for reader in readers:
        reader.close()


def test_messages_larger_than_the_whole_ring_arrive_intact(queue: MessageQueue) -> None:
    readers = readers_of(queue)
    big = os.urandom(50_000)  # ~200 chunks of a 4-chunk ring
    pending = [in_thread(lambda r=r: [r.dequeue(timeout=5) for _ in range(3)]) for r in readers]
    queue.enqueue("before", timeout=5)
    queue.enqueue(big, timeout=5)
    queue.enqueue("after", timeout=5)
    assert [result() for result in pending] == [["before", big, "after"]] * 2
    for reader in readers:
        reader.close()


def exact_fit(chunk_bytes: int) -> bytes:
    """A bytes object whose message is exactly chunk_bytes long (7 header bytes + pickle)."""
    for size in range(chunk_bytes):
        if 7 + len(pickle.dumps(b"x" * size, protocol=5)) == chunk_bytes:
            return b"x" * size
    raise AssertionError("no exact fit")


def test_messages_at_the_chunk_size_boundary(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    fits = exact_fit(256)
    for message in (fits, fits + b"y"):  # one chunk; then the smallest overflow
        queue.enqueue(message, timeout=1)
        assert reader.dequeue(timeout=1) == message
    assert bytes(queue._ring.get_data(0)[:1]) == b"\x00"  # the exact fit was not fragmented
    assert bytes(queue._ring.get_data(1)[:1]) == b"\x01"  # one byte more was
    reader.close()


def test_large_pickle_buffers_travel_out_of_band(ring_dir: str) -> None:
    with MessageQueue(1, 3 * MIB, 2, directory=ring_dir, wait_policy=QUICK) as writer:
        (reader,) = readers_of(writer)
        data = bytearray(os.urandom(2 * MIB))
        writer.enqueue({"tensor": pickle.PickleBuffer(data)})
        got = reader.dequeue(timeout=1)["tensor"]
        writer.enqueue("overwrite the chunk")
        assert isinstance(got, bytearray) and got == data  # a private copy, not the chunk
        assert reader.dequeue(timeout=1) == "overwrite the chunk"
        reader.close()


def test_dequeue_times_out_on_an_empty_queue(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    with pytest.raises(RingTimeout, match="reader 0 of ring"):
        reader.dequeue(timeout=0.05)
    queue.enqueue("late")
    assert reader.dequeue(timeout=1) == "late"
    reader.close()


def test_a_timed_out_enqueue_sends_nothing(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    for index in range(4):
        queue.enqueue(index)
    with pytest.raises(RingTimeout, match=r"waiting for readers \[0\]"):
        queue.enqueue("lost", timeout=0.05)
    assert [reader.dequeue(timeout=1) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RingTimeout):
        reader.dequeue(timeout=0.05)
    reader.close()


def test_a_message_cut_short_by_a_timeout_is_dropped_by_readers(
    queue: MessageQueue, caplog: pytest.LogCaptureFixture
) -> None:
    (reader,) = readers_of(queue, 1)
    with pytest.raises(RingTimeout) as caught:
        queue.enqueue(b"z" * 5000, timeout=0.1)  # needs ~21 chunks; the reader sleeps
    assert "of the message were sent; readers drop that part" in str(caught.value.__notes__)
    result = in_thread(lambda: reader.dequeue(timeout=5))
    queue.enqueue("next", timeout=5)
    with caplog.at_level(logging.WARNING, logger="kvshm.ipc.codec"):
        assert result() == "next"
    reader.close()


def test_cancel_ends_a_blocked_dequeue_and_enqueue(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    with pytest.raises(WaitCancelled):
        reader.dequeue(cancel=cancel)
    for index in range(4):
        queue.enqueue(index)
    with pytest.raises(WaitCancelled):
        queue.enqueue("blocked", cancel=cancel)
    reader.close()


def test_long_waits_warn_unless_indefinite(ring_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    policy = WaitPolicy(warn_interval_seconds=0.03, spin_seconds=0)
    with MessageQueue(1, 256, 2, directory=ring_dir, wait_policy=policy) as writer:
        reader = MessageQueue.create_from_handle(writer.export_handle(), wait_policy=policy)
        writer.wait_until_ready(timeout=1)
        with caplog.at_level(logging.WARNING, logger="kvshm.ipc"):
            with pytest.raises(RingTimeout):
                reader.dequeue(timeout=0.1, indefinite=True)
            assert not caplog.records
            with pytest.raises(RingTimeout):
                reader.dequeue(timeout=0.1)
            assert any("still waiting" in record.getMessage() for record in caplog.records)
        reader.close()


def test_each_end_does_only_its_own_job(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    with pytest.raises(IpcError, match="only readers receive"):
        queue.dequeue(timeout=0)
    with pytest.raises(IpcError, match="only the writer sends"):
        reader.enqueue("x")
    with pytest.raises(IpcError, match="only the writer sends"):
        reader.evict_reader(0)
    assert (queue.is_writer, queue.rank, reader.is_writer, reader.rank) == (True, None, False, 0)
    reader.close()


def test_handshake_waits_for_every_reader(queue: MessageQueue) -> None:
    handle = queue.export_handle()
    first = MessageQueue.create_from_handle(handle, wait_policy=QUICK)
    with pytest.raises(RingTimeout, match=r"waiting for readers \[1\] to join"):
        queue.wait_until_ready(timeout=0.05)
    second = MessageQueue.create_from_handle(handle, wait_policy=QUICK)
    queue.wait_until_ready(timeout=1)
    first.wait_until_ready(timeout=1)
    second.wait_until_ready(timeout=1)
    assert queue.joined_readers() == [0, 1]
    first.close()
    second.close()


def test_the_creator_removes_the_ring_and_readers_do_not(ring_dir: str) -> None:
    writer = MessageQueue(1, 256, 2, directory=ring_dir, name="events")
    reader = MessageQueue.attach(writer.path)
    reader.close()
    assert os.path.exists(writer.path)
    writer.close()
    assert not os.path.exists(writer.path)
    writer.close()  # idempotent


def test_a_restarted_writer_resumes_the_ring(ring_dir: str) -> None:
    first = MessageQueue(1, 256, 4, directory=ring_dir, name="events", wait_policy=QUICK)
    reader = MessageQueue.attach(first.path, wait_policy=QUICK)
    first.wait_until_ready(timeout=1)
    first.enqueue("from the first writer")
    first._require_writer()._release_role()  # the agent dies: its lock goes, its file stays
    second = MessageQueue.resume_writer(first.path, wait_policy=QUICK, remove_on_close=True)
    second.enqueue({"agent": "restarted"})
    assert reader.dequeue(timeout=1) == "from the first writer"
    assert reader.dequeue(timeout=1) == {"agent": "restarted"}
    reader.close()
    first._ring.close(unlink=False)
    second.close()


class OnlyTheWriterKnows:
    """Unpickling finds a class that no longer is what it was when pickled."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_fails_to_rebuild, ("gone",))


def _fails_to_rebuild(why: str) -> None:
    raise LookupError(f"cannot rebuild: {why}")


def test_an_unpicklable_object_sends_nothing_and_the_queue_goes_on(queue: MessageQueue) -> None:
    (reader,) = readers_of(queue, 1)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        queue.enqueue(lambda: None)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        queue.enqueue([b"x" * 70_000, lambda: None])  # fails in the overflow path too
    queue.enqueue("after")
    assert reader.dequeue(timeout=1) == "after"
    reader.close()


def test_a_message_that_cannot_be_unpickled_is_consumed_and_reported(
    queue: MessageQueue,
) -> None:
    (reader,) = readers_of(queue, 1)
    queue.enqueue(OnlyTheWriterKnows())
    queue.enqueue("next")
    with pytest.raises(LookupError, match="cannot rebuild"):
        reader.dequeue(timeout=1)
    assert reader.dequeue(timeout=1) == "next"
    reader.close()


def test_an_idle_reader_is_woken_by_the_writer_not_by_its_sleep_ending(ring_dir: str) -> None:
    drowsy = WaitPolicy(spin_seconds=0, min_sleep_seconds=2.0, max_sleep_seconds=2.0)
    with MessageQueue(1, 256, 4, directory=ring_dir, wait_policy=drowsy) as writer:
        reader = MessageQueue.create_from_handle(writer.export_handle(), wait_policy=drowsy)
        writer.wait_until_ready(timeout=5)
        received = in_thread(lambda: (reader.dequeue(timeout=10), time.monotonic()))
        time.sleep(0.2)  # the reader is asleep by now, for 2 s at a time
        assert bytes(writer._ring.registry.sleepers) == b"\x01"
        sent = time.monotonic()
        writer.enqueue("wake up")
        message, arrived = received()
        assert message == "wake up"
        assert arrived - sent < 0.5  # woken, not timed out
        assert bytes(writer._ring.registry.sleepers) == b"\x00"
        reader.close()


# -- a ring the tenant scribbled on (it can write the file) -------------------------------------


@pytest.fixture
def shm_queue(shm_ring_dir: str) -> Iterator[MessageQueue]:
    writer = MessageQueue(1, 4096, 8, directory=shm_ring_dir, wait_policy=QUICK)
    yield writer
    writer.close()


def scribble_next_chunk(writer: MessageQueue, data: bytes) -> None:
    """Publish a placeholder, then overwrite the chunk it went to as the tenant would."""
    layout = writer._ring.layout
    index = writer._ring.registry.writer_cursor[0]
    writer.enqueue("placeholder")
    with scribbling_on(writer.path) as mapping:
        offset = layout.chunk_offset(index)
        mapping[offset : offset + len(data)] = data


def test_a_reader_skips_messages_over_its_limit_and_goes_on(shm_queue: MessageQueue) -> None:
    reader = MessageQueue.attach(shm_queue.path, wait_policy=QUICK, max_message_bytes=8192)
    assert shm_queue.joined_readers() == [0]
    shm_queue.enqueue(b"x" * 20_000)  # fragments through five chunks
    shm_queue.enqueue("small")
    with pytest.raises(MessageTooLargeError, match=r"at most 8192 bytes \(max_message_bytes\)"):
        reader.dequeue(timeout=1)
    assert reader.dequeue(timeout=1) == "small"
    reader.close()


def test_a_scribbled_length_costs_readers_no_memory(shm_queue: MessageQueue) -> None:
    (reader,) = readers_of(shm_queue, 1)
    announced = 256 * MIB  # within the default limit: only the bytes that arrive are held
    scribble_next_chunk(shm_queue, FRAGMENT.pack(1, FIRST, announced))
    shm_queue.enqueue("next")
    tracemalloc.start()
    try:
        assert reader.dequeue(timeout=1) == "next"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB, f"the reader allocated {peak} bytes for a scribbled length"
    reader.close()


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (FRAGMENT.pack(1, FIRST, 0), "announces 0 bytes"),
        (struct.pack(">BHI", 0, 2, 4096 - 7), "claims 2 buffers"),
    ],
)
def test_a_scribbled_message_is_a_format_error_and_the_next_one_arrives(
    shm_queue: MessageQueue, damage: bytes, error: str
) -> None:
    (reader,) = readers_of(shm_queue, 1)
    scribble_next_chunk(shm_queue, damage)
    shm_queue.enqueue("next")
    with pytest.raises(RingFormatError, match=error):
        reader.dequeue(timeout=1)
    assert reader.dequeue(timeout=1) == "next"
    reader.close()


def test_a_limit_that_is_not_a_size_is_refused_before_a_slot_is_taken(
    shm_queue: MessageQueue,
) -> None:
    with pytest.raises(RingConfigError, match="max_message_bytes"):
        MessageQueue.attach(shm_queue.path, max_message_bytes=0)
    (reader,) = readers_of(shm_queue, 1)  # the refused reader took no slot
    reader.close()
