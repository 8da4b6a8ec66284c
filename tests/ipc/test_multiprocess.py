"""One writer and reader processes (spawned, so each attaches through its handle or path)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvshm.ipc import MessageQueue, ReaderDiedError, RingHandle, ShmRingBuffer
from tests.ipc.procs import (
    QUICK,
    SPAWN,
    MessagePlan,
    die_while_writing_a_chunk,
    read_plan,
    read_until_the_writer_dies,
    receive_all,
    send_plan,
    write_then_giant,
)

CHUNK = 4096


@contextmanager
def processes(*specs: tuple[Any, tuple[Any, ...]]) -> Iterator[list[Any]]:
    """Start spawned processes; on the way out, make sure none outlives the test."""
    started = [SPAWN.Process(target=target, args=args, daemon=True) for target, args in specs]
    for process in started:
        process.start()
    try:
        yield started
    finally:
        for process in started:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)


@pytest.mark.parametrize("n_reader", [1, 2, 4])
def test_every_reader_gets_every_message_exactly_once_in_order(
    ring_dir: str, n_reader: int
) -> None:
    count = 100_000
    plan = MessagePlan(count, CHUNK)
    assert sum(size > CHUNK for size in plan.sizes) > 1000  # oversize ones are part of it
    assert len(plan.out_of_band) == 3
    results = SPAWN.Queue()
    with MessageQueue(n_reader, CHUNK, 256, directory=ring_dir, wait_policy=QUICK) as queue:
        handle = queue.export_handle()
        readers = [
            (read_plan, (handle, None, 0, count, CHUNK, count, results)) for _ in range(n_reader)
        ]
        with processes(*readers):
            queue.wait_until_ready(timeout=60)
            send_plan(queue, plan, range(count))
            reports = sorted(results.get(timeout=120) for _ in range(n_reader))
    assert reports == [(rank, count, None) for rank in range(n_reader)]


def test_a_reader_killed_mid_stream_fails_the_writer_and_a_replacement_rejoins(
    ring_dir: str,
) -> None:
    count, later = 20_000, 2_000
    plan = MessagePlan(count + later, CHUNK)
    results, progress = SPAWN.Queue(), SPAWN.Value("l", 0)
    with MessageQueue(2, CHUNK, 64, directory=ring_dir, wait_policy=QUICK) as queue:
        handle = queue.export_handle()
        survivor = (read_plan, (handle, 0, 0, count + later, CHUNK, count + later, results))
        victim = (read_plan, (handle, 1, 0, count, CHUNK, count + later, results, progress))
        with processes(survivor, victim) as (_, victim_process):
            queue.wait_until_ready(timeout=60)
            sent = 0
            while progress.value < 1000:  # the victim is reading when it is killed
                send_plan(queue, plan, range(sent, sent + 100))
                sent += 100
            os.kill(victim_process.pid, signal.SIGKILL)
            deaths: list[ReaderDiedError] = []

            def evict(error: ReaderDiedError) -> None:
                deaths.append(error)
                queue.evict_reader(error.rank)

            started = time.monotonic()
            send_plan(queue, plan, range(sent, count), on_dead_reader=evict)
            assert len(deaths) == 1  # the writer was stopped by the dead reader, once
            assert deaths[0].rank == 1 and f"pid {victim_process.pid}" in str(deaths[0])
            assert time.monotonic() - started < 30
            assert queue.joined_readers() == [0]
            # a replacement takes slot 1 and gets what is sent after it joined
            replacement = (read_plan, (handle, 1, count, later, CHUNK, count + later, results))
            with processes(replacement):
                while queue.joined_readers() != [0, 1]:
                    time.sleep(0.01)
                send_plan(queue, plan, range(count, count + later))
                reports = sorted(results.get(timeout=120) for _ in range(2))
    assert reports == [(0, count + later, None), (1, later, None)]


def test_readers_never_see_a_torn_message_from_a_writer_killed_mid_message(
    ring_dir: str,
) -> None:
    count, chunk, chunks = 2_000, 1024, 64
    handles, giant_started, results = SPAWN.Queue(), SPAWN.Event(), SPAWN.Queue()
    writer = (
        write_then_giant,
        (ring_dir, 2, chunk, chunks, count, 32 << 20, handles, giant_started),
    )
    with processes(writer) as (writer_process,):
        handle: RingHandle = handles.get(timeout=60)
        readers = [(read_until_the_writer_dies, (handle, (count, chunk), results))] * 2
        with processes(*readers), ShmRingBuffer.attach(handle.path) as watcher:
            assert giant_started.wait(60)
            cursor = watcher.registry.writer_cursor
            published, last = 0, cursor[0]
            while published < 3 * chunks:  # the giant message is well under way
                now = cursor[0]
                published += (now - last) % chunks
                last = now
                time.sleep(0.0002)
            os.kill(writer_process.pid, signal.SIGKILL)
            reports = [results.get(timeout=60) for _ in range(2)]
        os.unlink(handle.path)  # its creator was killed: nobody else removes it
    for checked, problem, discarded in reports:
        assert problem is None
        assert checked == count  # every finished message, and nothing of the giant one
        assert discarded > 0  # the kill did land in the middle of the giant message


def test_a_chunk_half_written_by_a_killed_writer_is_never_delivered(ring_dir: str) -> None:
    count, handles, results = 50, SPAWN.Queue(), SPAWN.Queue()
    with processes((die_while_writing_a_chunk, (ring_dir, count, handles))):
        handle: RingHandle = handles.get(timeout=60)
        with processes((read_until_the_writer_dies, (handle, None, results))):
            checked, problem, discarded = results.get(timeout=60)
    os.unlink(handle.path)  # its creator was killed: nobody else removes it
    assert (checked, problem, discarded) == (count, None, 0)


def test_attach_by_handle_by_path_and_by_pickled_ring_from_other_processes(
    ring_dir: str,
) -> None:
    results = SPAWN.Queue()
    with MessageQueue(3, 512, 8, directory=ring_dir, name="events", wait_policy=QUICK) as queue:
        handle = queue.export_handle()
        ring_pickle = pickle.loads(pickle.dumps(ShmRingBuffer.attach(queue.path)))
        specs = [
            (receive_all, (handle, 3, results)),
            (receive_all, (queue.path, 3, results)),
            (receive_all, (ring_pickle, 3, results)),  # travels as its handle
        ]
        with processes(*specs):
            queue.wait_until_ready(timeout=60)
            sent = [{"event": "region-ready"}, ("drain", 30.0), "agent-restarted"]
            for message in sent:
                queue.broadcast_object(message)
            reports = sorted(results.get(timeout=60) for _ in specs)
        ring_pickle.close()
    assert reports == sorted([("RingHandle", sent), ("ShmRingBuffer", sent), ("str", sent)])
