"""Child processes of the multiprocess tests, and the message plan they check against.

Spawned children import this module by name, so it holds everything they run."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import signal
from collections.abc import Callable
from typing import Any

from kvshm.ipc import (
    MessageQueue,
    ReaderDiedError,
    RingHandle,
    RingWriter,
    ShmRingBuffer,
    WaitPolicy,
    WriterDiedError,
)
from kvshm.ipc.codec import MessageEncoder

SPAWN = mp.get_context("spawn")
OOB_BYTES = 3 << 19  # 1.5 MiB: above the 1 MiB out-of-band threshold
_POOL_BYTES = 2 << 20

# short intervals so that dead peers and timeouts show within a test's patience
QUICK = WaitPolicy(
    spin_seconds=0.0005,
    min_sleep_seconds=0.0002,
    max_sleep_seconds=0.002,
    warn_interval_seconds=60,
    liveness_interval_seconds=0.02,
    peer_death_grace_seconds=0.2,
)


class MessagePlan:
    """Message seq of a run: (seq, payload), the payload's size and bytes fixed by the seed.

    Mostly small messages, one in ten around the chunk size, one in fifty several chunks
    long, and three with an out-of-band buffer of 1.5 MiB."""

    def __init__(self, count: int, chunk_bytes: int, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.pool = rng.randbytes(_POOL_BYTES)
        self.sizes = []
        for _ in range(count):
            draw = rng.random()
            if draw < 0.02:
                self.sizes.append(rng.randint(chunk_bytes + 1, 16 * chunk_bytes))
            elif draw < 0.12:
                self.sizes.append(rng.randint(chunk_bytes - 64, chunk_bytes + 64))
            else:
                self.sizes.append(rng.randint(0, 256))
        self.out_of_band = {count // 4, count // 2, 3 * count // 4} if count >= 8 else set()

    def payload(self, seq: int) -> bytes:
        size = OOB_BYTES if seq in self.out_of_band else self.sizes[seq]
        start = (seq * 7919) % (len(self.pool) - size)
        return self.pool[start : start + size]

    def message(self, seq: int) -> tuple[int, Any]:
        """What the writer sends."""
        data = self.payload(seq)
        if seq in self.out_of_band:
            return seq, pickle.PickleBuffer(bytearray(data))
        return seq, data

    def check(self, seq: int, got: Any) -> str | None:
        """None if got is message seq, else what is wrong with it."""
        if not isinstance(got, tuple) or len(got) != 2:
            return f"message {seq}: got {type(got).__name__}, not a (seq, payload) pair"
        if got[0] != seq:
            return f"message {seq}: got message {got[0]} instead"
        if got[1] != self.payload(seq):
            return f"message {seq}: payload of {len(got[1])} bytes differs"
        return None


def attach(where: RingHandle | str, rank: int | None = None) -> MessageQueue:
    if isinstance(where, RingHandle):
        return MessageQueue.create_from_handle(where, rank, wait_policy=QUICK)
    return MessageQueue.attach(where, rank, wait_policy=QUICK)


def read_plan(
    where: RingHandle | str,
    rank: int | None,
    first: int,
    count: int,
    chunk_bytes: int,
    plan_length: int,
    results: Any,
    progress: Any = None,
) -> None:
    """Join, then check `count` messages starting at seq `first`. Reports (rank, checked,
    problem); the problem is None, a mismatch, or the error that ended the reading."""
    plan = MessagePlan(plan_length, chunk_bytes)
    queue = attach(where, rank)
    queue.wait_until_ready(timeout=30)
    checked, problem = 0, None
    try:
        for seq in range(first, first + count):
            problem = plan.check(seq, queue.dequeue(timeout=30))
            if problem:
                break
            checked += 1
            if progress is not None:
                progress.value = checked
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    results.put((queue.rank, checked, problem))
    queue.close()


def read_until_the_writer_dies(
    where: RingHandle | str, plan_args: tuple[int, int] | None, results: Any
) -> None:
    """Check messages (the plan's, or small_message()s if plan_args is None) until the
    writer is gone. Reports (checked, problem, bytes of an unfinished message dropped)."""
    if plan_args is None:
        check: Callable[[int, Any], str | None] = _check_small
    else:
        check = MessagePlan(*plan_args).check
    queue = attach(where)
    queue.wait_until_ready(timeout=30)
    checked, problem, discarded = 0, None, -1
    try:
        while True:
            problem = check(checked, queue.dequeue(timeout=30))
            if problem:
                break
            checked += 1
    except WriterDiedError as exc:
        discarded = exc.discarded_bytes
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    results.put((checked, problem, discarded))
    queue.close()


def _check_small(seq: int, got: Any) -> str | None:
    return None if got == small_message(seq) else f"message {seq}: got {got!r}"


def write_then_giant(
    directory: str,
    n_reader: int,
    chunk_bytes: int,
    chunks: int,
    plan_length: int,
    giant_bytes: int,
    handles: Any,
    giant_started: Any,
) -> None:
    """Writer that sends the plan's messages, then one message far larger than the ring,
    during which the test kills it."""
    plan = MessagePlan(plan_length, chunk_bytes)
    queue = MessageQueue(n_reader, chunk_bytes, chunks, directory=directory, wait_policy=QUICK)
    handles.put(queue.export_handle())
    queue.wait_until_ready(timeout=30)
    for seq in range(plan_length):
        queue.enqueue(plan.message(seq), timeout=30)
    giant = (plan_length, bytes(giant_bytes))
    giant_started.set()
    queue.enqueue(giant, timeout=60)
    handles.put("the giant message got through: the test did not kill the writer in time")


def die_while_writing_a_chunk(directory: str, count: int, handles: Any) -> None:
    """Writer that sends `count` small messages, then dies with a chunk half filled."""
    ring = ShmRingBuffer(1, 256, 8, directory=directory)
    writer, encoder = RingWriter(ring, QUICK), MessageEncoder()
    handles.put(ring.handle())
    writer.wait_until_ready(timeout=30)
    for seq in range(count):
        assert encoder.encode_into(writer.acquire(timeout=30), small_message(seq))
        writer.publish()
    chunk = writer.acquire(timeout=30)
    assert encoder.encode_into(chunk, small_message(count))
    chunk[20:] = b"\xff" * (len(chunk) - 20)  # half of the next message, then torn
    os.kill(os.getpid(), signal.SIGKILL)


def small_message(seq: int) -> tuple[str, int, bytes]:
    return ("small", seq, bytes(seq % 97))


def send_plan(
    queue: MessageQueue,
    plan: MessagePlan,
    seqs: range,
    on_dead_reader: Callable[[ReaderDiedError], None] | None = None,
) -> int:
    """Enqueue the plan's messages; a ReaderDiedError goes to on_dead_reader and the message is
    sent again. Returns how many ReaderDiedErrors there were."""
    deaths = 0
    for seq in seqs:
        while True:
            try:
                queue.enqueue(plan.message(seq), timeout=30)
                break
            except ReaderDiedError as exc:
                if on_dead_reader is None:
                    raise
                deaths += 1
                on_dead_reader(exc)
    return deaths


def receive_all(where: RingHandle | str | ShmRingBuffer, count: int, results: Any) -> None:
    """Attach (by handle, path, or an unpickled ring) and report the next `count` messages."""
    if isinstance(where, ShmRingBuffer):
        queue = MessageQueue.reader_of(where, wait_policy=QUICK)
    else:
        queue = attach(where)
    queue.wait_until_ready(timeout=30)
    results.put((type(where).__name__, [queue.dequeue(timeout=30) for _ in range(count)]))
    queue.close()
