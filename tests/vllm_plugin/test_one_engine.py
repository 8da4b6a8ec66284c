"""A region serves exactly one engine: each worker write-locks file 0's byte of its rank at
attach, so a second engine's worker of the same rank is refused at once (real processes, real
files on /dev/shm), while the ranks of one engine attach side by side and a dead or released
holder leaves the region free for the next engine."""

from __future__ import annotations

import fcntl
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvshm.vllm.attach import RegionServesAnotherEngine, attach_region
from kvshm.vllm.geometry import RegionGeometry
from tests.vllm_plugin.regions import agent_region, is_held, remove_region
from tests.vllm_plugin.test_ranks import (
    CELL,
    CHUNKS,
    SHM,
    WORKERS,
    check_rank,
    start_rank,
    stored_by,
)

GEOMETRY = RegionGeometry(CHUNKS, CELL * WORKERS, CELL, WORKERS, False)


@pytest.fixture
def instance_id() -> Iterator[str]:
    """An agent-made region of two workers on /dev/shm, as rank_process attaches it."""
    name = f"kvshm-one-engine-{uuid.uuid4().hex[:8]}"
    agent_region(SHM, name, CHUNKS, CELL, WORKERS)
    try:
        yield name
    finally:
        remove_region(SHM, name)


@pytest.fixture
def storing_rank_0(instance_id: str) -> Iterator[tuple[Any, list[dict[str, list[int]]]]]:
    """Rank 0 of a first engine in its own process, rewriting what it stored until killed."""
    process = start_rank(instance_id, 0, "cpu", CHUNKS, forever=True)
    try:
        yield process, stored_by(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_second_engines_worker_of_the_same_rank_is_refused_and_the_first_keeps_storing(
    instance_id: str, storing_rank_0: tuple[Any, list[dict[str, list[int]]]]
) -> None:
    first, stored = storing_rank_0
    with pytest.raises(RegionServesAnotherEngine) as refused:
        attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    message = str(refused.value)
    assert f"instanceId {instance_id!r}" in message
    assert "another engine's worker of rank 0" in message
    assert "the kernel names no process" in message  # OFD locks report pid -1: said plainly
    assert "exactly one engine per node" in message
    assert "anti-affinity" in message and "maxSurge: 0" in message and "docs/deploy.md" in message
    assert first.poll() is None, "the first engine's worker died"
    assert is_held(f"{SHM}/vllm_offload_{instance_id}.mmap")
    assert check_rank(instance_id, 0, stored, CHUNKS) > 0  # still storing the same bytes


def test_the_ranks_of_one_engine_in_separate_processes_all_attach(
    instance_id: str, storing_rank_0: tuple[Any, list[dict[str, list[int]]]]
) -> None:
    region = attach_region(SHM, instance_id, GEOMETRY, 1, 2.0)
    region.cleanup()
    assert storing_rank_0[0].poll() is None


def test_a_killed_engines_rank_is_free_for_the_next_engine(
    instance_id: str, storing_rank_0: tuple[Any, list[dict[str, list[int]]]]
) -> None:
    first, _ = storing_rank_0
    with pytest.raises(RegionServesAnotherEngine):
        attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    region = attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)  # the kernel dropped the lock
    region.cleanup()


def test_a_rank_released_by_cleanup_can_be_attached_again_in_the_same_process(
    instance_id: str,
) -> None:
    """The lock belongs to the attach (its open file description), not to the process: a
    second attach of rank 0 in this process is refused until the first is cleaned up."""
    first = attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    try:
        with pytest.raises(RegionServesAnotherEngine):
            attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    finally:
        first.cleanup()
    again = attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    again.cleanup()


def test_a_process_lock_on_the_rank_byte_is_named_by_its_pid(instance_id: str) -> None:
    """A traditional (process-owned) lock on the byte conflicts too, and the kernel names its
    process: the error does."""
    path = f"{SHM}/vllm_offload_{instance_id}.mmap"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        fd = os.open(path, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)  # byte 0: rank 0's
        os.write(ready_w, b"x")
        signal.pause()
    try:
        os.read(ready_r, 1)
        with pytest.raises(RegionServesAnotherEngine, match=f"rank 0 \\(process {pid}\\)"):
            attach_region(SHM, instance_id, GEOMETRY, 0, 2.0)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
