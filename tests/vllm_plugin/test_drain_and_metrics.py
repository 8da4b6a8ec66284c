"""The plugin follows the agent's drain event, and its transfer metrics reach vLLM's registry."""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from kvshm.agent.drain.notify import CHUNK_BYTES, CHUNKS, EVENTS_RING
from kvshm.ipc import MessageQueue, WaitPolicy
from kvshm.ipc.codec import FIRST, FRAGMENT
from kvshm.region.drain_event import DrainEvent
from kvshm.vllm.attach import RegionServesAnotherEngine, attach_region
from kvshm.vllm.events import ATTACH_TIMEOUT_S, DRAIN_EVENT_MAX_BYTES, DrainListener
from kvshm.vllm.worker import RegionDrainedError
from tests.ipc.tenant import scribbling_on
from tests.source_roots import pythonpath
from tests.vllm_plugin.checks import finish
from tests.vllm_plugin.conftest import Engine
from tests.vllm_plugin.engine import CPU_PAGE, GPU_BLOCKS, NUM_CHUNKS, TINY_LAYERS, TINY_PAGE
from tests.vllm_plugin.jobs import Job
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches
from tests.vllm_plugin.regions import agent_region, is_held
from tests.vllm_plugin.test_plugin_cpu import spec_of

REPO = Path(__file__).resolve().parents[2]


def agent_events(shm_dir: Path) -> MessageQueue:
    """The agent's event queue in the region directory, as kvshm.agent.drain.notify makes it."""
    return MessageQueue(
        2,
        CHUNK_BYTES,
        CHUNKS,
        name=EVENTS_RING,
        directory=str(shm_dir),
        wait_policy=WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.01),
        on_dead_reader="evict",
    )


def test_drain_finishes_jobs_in_flight_then_releases_the_region(
    engine: Engine,
    shm_dir: Path,
) -> None:
    path = agent_region(str(shm_dir), engine.engine_id, NUM_CHUNKS, CPU_PAGE, 1)
    events = agent_events(shm_dir)
    try:
        spec = spec_of(engine)
        spec.settings = dataclasses.replace(spec.settings, region_dir=str(shm_dir))
        kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
        worker = spec.get_worker(kv)
        assert is_held(path)
        with pytest.raises(RegionServesAnotherEngine):  # another engine's worker 0
            attach_region(str(shm_dir), engine.engine_id, spec.region_geometry, 0, 2.0)
        # the listener joins the queue in its own thread; a drain sent before it joined is lost
        assert worker.drain_listener is not None and worker.drain_listener.wait_listening(10)
        job = Job([1, 2, 3, 4], [5, 6], [4], [0])
        assert worker.submit_store(1, *job.specs())
        event = DrainEvent("team-a/llama", engine.engine_id, "region deleted", time.time() + 30)
        events.enqueue(event.to_message(), timeout=1.0)
        deadline = time.monotonic() + 10
        while is_held(path):
            assert time.monotonic() < deadline, "the engine did not release the drained region"
            time.sleep(0.02)
        # the release let go of its rank too: the next engine's worker 0 attaches
        attach_region(str(shm_dir), engine.engine_id, spec.region_geometry, 0, 2.0).cleanup()
        assert worker.drained is not None and worker.drained.reason == "region deleted"
        # the job in flight at the drain still reaches vLLM, finished
        assert finish(worker, {1})[1].success
        with pytest.raises(RegionDrainedError, match="drained region team-a/llama"):
            worker.submit_store(2, *job.specs())
        with pytest.raises(RegionDrainedError, match="must be restarted"):
            worker.submit_load(3, *reversed(job.specs()))
        worker.shutdown()
        assert os.path.exists(path), "removing the file is the agent's job"
    finally:
        events.close()


def test_the_listener_joins_in_its_thread_and_retries_until_the_queue_exists(
    shm_dir: Path,
) -> None:
    drains: list[DrainEvent] = []
    started = time.perf_counter()
    listener = DrainListener(str(shm_dir), "late", drains.append, retry_s=0.05)
    # joining no longer blocks the worker's constructor (it waited a whole attach timeout)
    assert time.perf_counter() - started < ATTACH_TIMEOUT_S / 2
    assert not listener.listening
    time.sleep(0.2)  # a few failed tries
    events = agent_events(shm_dir)
    try:
        assert listener.wait_listening(10), "the listener never joined the agent's queue"
        for instance in ("another", "late"):
            drain = DrainEvent(f"team-a/{instance}", instance, "node drained", time.time() + 30)
            events.enqueue(drain.to_message(), timeout=1.0)
        deadline = time.monotonic() + 10
        while not drains:
            assert time.monotonic() < deadline, "the drain was not followed"
            time.sleep(0.02)
        assert [d.instance_id for d in drains] == ["late"]
        assert drains[0].reason == "node drained"
    finally:
        listener.close()
        events.close()
    assert not listener.listening


def test_a_listener_closed_before_any_queue_exists_stops(shm_dir: Path) -> None:
    listener = DrainListener(str(shm_dir), "never", lambda _: None, retry_s=0.05)
    time.sleep(0.1)
    started = time.perf_counter()
    listener.close()
    assert time.perf_counter() - started < 2 * ATTACH_TIMEOUT_S
    assert not listener.listening
    assert not (shm_dir / EVENTS_RING).exists()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def send_and_see_read(events: MessageQueue, message: object, rank: int = 0) -> None:
    """Enqueue message and wait until reader `rank` has taken it off the ring."""
    chunk = events._ring.registry.writer_cursor[0]
    events.enqueue(message, timeout=5.0)
    wait_for(lambda: events._ring.read_flags[chunk][rank] == 1, f"reader {rank} read nothing")


def publish_damaged(events: MessageQueue, data: bytes) -> None:
    """A chunk of `data` reaches the listener: what it sees when the tenant scribbled over a
    message between its publication and its reading (published raw here, as the listener would
    otherwise race the scribble)."""
    writer = events._writer
    assert writer is not None
    chunk = writer.acquire(timeout=5.0)
    chunk[: len(data)] = data
    writer.publish()


def drain_for(instance: str) -> dict[str, object]:
    return DrainEvent("team-a/llama", instance, "node drained", time.time() + 30).to_message()


def test_the_listener_steps_over_damage_in_its_ring_and_still_follows_the_drain(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvshm.vllm.events")
    events = agent_events(shm_dir)
    drains: list[DrainEvent] = []
    listener = DrainListener(str(shm_dir), "me", drains.append, retry_s=0.05)
    try:
        assert listener.wait_listening(10)
        # the tenant forges the writer's answer to the join: a start past the ring's end
        registry = events._ring.registry
        with scribbling_on(events.path) as mapping:
            struct.pack_into("<I", mapping, events._ring.layout.reader_slot_offset(0) + 4, 1000)
            mapping[events._ring.layout.acks_offset] = registry.requests[0]
        wait_for(lambda: "start at chunk 1000" in caplog.text, "the forged start was not seen")
        assert listener.listening
        events.joined_readers()  # carries out the join the listener asked for again
        send_and_see_read(events, drain_for("another"))
        publish_damaged(events, FRAGMENT.pack(1, FIRST, 0))  # a message of no bytes
        send_and_see_read(events, drain_for("another"))
        # larger than any drain event: skipped unread, as a scribbled length would be
        send_and_see_read(events, {"type": "noise", "pad": b"x" * (DRAIN_EVENT_MAX_BYTES + 1)})
        assert "MessageTooLargeError" in caplog.text and "announces 0 bytes" in caplog.text
        assert listener.listening
        events.enqueue(drain_for("me"), timeout=5.0)
        wait_for(lambda: bool(drains), "the drain after the damage was not followed")
        assert [drain.instance_id for drain in drains] == ["me"]
        wait_for(lambda: not listener.listening, "a listener whose drain came still listens")
        assert events.joined_readers() == []  # and it left the queue
    finally:
        listener.close()
        events.close()


def test_an_evicted_listener_joins_again_and_follows_the_drain(shm_dir: Path) -> None:
    events = agent_events(shm_dir)
    drains: list[DrainEvent] = []
    # it re-joins retry_s after the eviction: long enough to see it not listening meanwhile
    listener = DrainListener(str(shm_dir), "me", drains.append, retry_s=0.5)
    try:
        assert listener.wait_listening(10)
        events.joined_readers()
        send_and_see_read(events, drain_for("another"))
        events.evict_reader(0)  # as the agent does with a reader it took for dead
        wait_for(lambda: not listener.listening, "the evicted listener still says it listens")
        assert listener.wait_listening(10), "the evicted listener did not join again"
        wait_for(lambda: bool(events.joined_readers()), "the writer saw no new join")
        events.enqueue(drain_for("me"), timeout=5.0)
        wait_for(lambda: bool(drains), "the drain after the eviction was not followed")
    finally:
        listener.close()
        events.close()


def test_transfer_metrics_of_a_worker_process_reach_vllms_registry(
    engine: Engine,
    shm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    instance_id = f"metrics-{uuid.uuid4().hex[:8]}"
    blocks, page, layers = 8, 4096, 2
    agent_region(str(shm_dir), instance_id, blocks, page * layers, 1)
    metrics_dir = shm_dir / "prometheus"
    metrics_dir.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "PYTHONPATH": pythonpath(REPO),
    }
    args = [str(shm_dir), instance_id, str(blocks), str(page), str(layers)]
    subprocess.run(
        [sys.executable, "-m", "tests.vllm_plugin.store_once", *args], cwd=REPO, env=env, check=True
    )
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    registry = get_prometheus_registry()  # what vLLM's /metrics serves from
    assert registry is not REGISTRY
    moved = registry.get_sample_value("kvshm_transfer_bytes_total", {"direction": "gpu_to_cpu"})
    assert moved == 3 * page * layers
    jobs = registry.get_sample_value(
        "kvshm_transfer_jobs_total", {"direction": "gpu_to_cpu", "backend": "cpu"}
    )
    assert jobs == 1
