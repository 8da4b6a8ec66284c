"""A hostile tenant's smaller tricks: a truncated region file, a tmpfs filled under a populate, and
the documented worker handshake against the agent's own ring."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.ipc import MessageQueue
from kvshm.region.drain_event import EVENTS_RING
from tests.agent.hostile import (
    TENANT_UID,
    RunningAgent,
    tenant,
    tenant_manifest,
    tenant_process,
    traversable,
    write_regions,
)
from tests.waiting import wait_for

_TRUNCATE = """
import os, sys
os.truncate(sys.argv[1], 4096)
"""

_FILL = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600)
print("filling", flush=True)
try:
    while True:
        os.write(fd, b"x" * (1 << 20))
except OSError as exc:
    print("full", exc.errno, flush=True)
"""


def test_a_truncated_region_file_is_no_longer_reported_ready(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = traversable(shm_dir) / "root"
    write_regions(regions, "r.yaml", tenant_manifest("cut"), tenant_manifest("whole"))
    with RunningAgent(regions, root, "--no-http", "--resync-seconds", "1") as agent:
        agent.saw("tenant/cut  Ready")
        agent.saw("tenant/whole  Ready")
        tenant(_TRUNCATE, str(root / "tenant/cut/vllm_offload_cut.mmap"))
        agent.saw("tenant/cut  Failed")
        time.sleep(2)  # a few passes more: it stays Failed, the file untouched
        cut = [line for line in agent.lines if "tenant/cut  " in line]
    assert "is 4096 bytes but the layout needs 2097152 bytes" in cut[-1]
    assert "Ready" not in cut[-1] and "locked" not in cut[-1]
    assert (root / "tenant/cut/vllm_offload_cut.mmap").stat().st_size == 4096
    whole = [line for line in agent.lines if "tenant/whole  " in line]
    assert "tenant/whole  Ready" in whole[-1]  # the other region untouched


def _errors(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    found = re.findall(r'^kvshm_agent_errors_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: float(value) for reason, value in found}


@pytest.fixture
def tmpfs_256m() -> Iterator[Path]:
    """A 256 MiB tmpfs of its own: room for a region populated in several 64 MiB pieces."""
    path = Path(tempfile.mkdtemp(prefix="kvshm-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0755", "tmpfs", str(path)])
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        os.rmdir(path)


def test_a_tmpfs_filled_under_a_populate_counts_as_a_populate_failure(
    tmpfs_256m: Path, shm_dir: Path
) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = tmpfs_256m / "root"
    # 192 MiB in three 64 MiB pieces, one thread at 32 MiB/s: two seconds after each piece
    big = tenant_manifest("big", blocks=192, page=1 << 20, workers=1)
    write_regions(regions, "big.yaml", big)
    slow = ("--port", "0", "--populate-threads", "1", "--populate-rate", "32Mi")
    with RunningAgent(regions, root, *slow) as agent:
        path = root / "tenant/big/vllm_offload_big.mmap"
        wait_for(lambda: path.exists() and path.stat().st_blocks * 512 >= 64 << 20, 20, "a piece")
        # another writer (the tenant, in its own directory) takes the rest of the tmpfs
        filler = tenant_process(_FILL, str(root / "tenant/big/filler"))
        assert filler.stdout is not None and filler.stdout.readline() == "filling\n"
        assert filler.stdout.readline().startswith("full")
        filler.wait(10)
        agent.saw("tenant/big  Failed", timeout=30)
        errors = _errors(agent.url)
    assert errors["populate"] == 1 and errors["capacity"] == 0
    failed = next(line for line in agent.lines if "tenant/big  Failed" in line)
    assert "the partial files were removed" in failed


def test_the_documented_worker_handshake_works_against_the_agents_ring(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = traversable(shm_dir) / "root"
    write_regions(regions, "r.yaml", tenant_manifest("ipc"))
    with RunningAgent(regions, root, "--no-http", "--drain-grace-seconds", "1") as agent:
        agent.saw("tenant/ipc  Ready")
        ring = str(root / "tenant/ipc" / EVENTS_RING)
        ours, theirs = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker of the region: the tenant's uid, the docs' code
            code = 1
            try:
                os.close(ours)
                signal.alarm(60)
                os.setgroups([])
                os.setgid(TENANT_UID)
                os.setuid(TENANT_UID)
                events = MessageQueue.attach(ring)
                events.wait_until_ready(timeout=5)
                os.write(theirs, b"ready\n")
                event = events.dequeue(timeout=None, indefinite=True)
                os.write(theirs, f"{event['type']} {event['region']}\n".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(theirs)
        with os.fdopen(ours) as replies:
            assert replies.readline() == "ready\n"
            (regions / "r.yaml").unlink()
            assert replies.readline() == "drain tenant/ipc\n"
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        agent.saw("tenant/ipc  Removed")
