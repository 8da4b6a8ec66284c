"""Drain events through kvshm.ipc: a queue in the region directory that workers attach by path."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path

import yaml

from kvshm.agent.drain.notify import RegionEventQueues
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.api import NodeRegionPhase
from kvshm.ipc import MessageQueue
from kvshm.region.drain_event import EVENTS_RING
from tests.agent.builders import holding, local_agent, manifest, region, settle, view


def reconciler(root: Path, **settings: float) -> NodeReconciler:
    return NodeReconciler(
        RegionRoot(str(root)),
        RegionEventQueues(),
        ReconcilerSettings(**settings),  # type: ignore[arg-type]
        holds=HoldChecker(),
    )


def test_workers_attached_by_path_receive_the_drain_event(shm_dir: Path) -> None:
    root = shm_dir / "root"
    agent = reconciler(root)
    r1 = region(workers=2, access={"uid": 4321, "gid": 4321, "mode": 0o660})
    settle(agent, view(r1))
    ring = root / "ns1" / "r1" / EVENTS_RING
    st = ring.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 4321, 0o660)
    workers = [MessageQueue.attach(str(ring)) for _ in range(2)]  # as a pod sees /dev/shm/...
    try:
        result = settle(agent, view())
        assert result.reports["ns1/r1"].phase is NodeRegionPhase.REMOVED
        for worker in workers:
            event = worker.dequeue(timeout=5)
            assert event["type"] == "drain" and event["region"] == "ns1/r1"
            assert event["instanceId"] == "r1" and event["deadline"] > 0
            assert "region deleted" in event["reason"]
    finally:
        for worker in workers:
            worker.close()
    assert not (root / "ns1").exists()  # the ring went with the region


def test_a_restarted_agent_resumes_writing_the_same_queue(shm_dir: Path) -> None:
    root, regions = shm_dir / "root", shm_dir / "regions"
    regions.mkdir()
    (regions / "r1.yaml").write_text(yaml.safe_dump(manifest()))
    # the first agent is a process that exits without releasing anything (as on SIGKILL)
    first = subprocess.run(
        local_agent(regions, root, "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    ring = root / "ns1" / "r1" / EVENTS_RING
    inode = ring.stat().st_ino
    worker = MessageQueue.attach(str(ring))
    try:
        restarted = reconciler(root, drain_grace_seconds=30)
        r1 = region(access={"uid": os.geteuid(), "gid": os.getegid()})  # local mode's owner
        settle(restarted, view(r1))  # adopted: the ring is resumed, not replaced
        assert ring.stat().st_ino == inode
        with holding(root / "ns1" / "r1" / "vllm_offload_r1.mmap"):
            draining = restarted.reconcile(view())
            assert draining.reports["ns1/r1"].phase is NodeRegionPhase.DRAINING
            assert worker.dequeue(timeout=5)["type"] == "drain"
            assert ring.exists()  # kept while the region waits for its holders
    finally:
        worker.close()


def test_a_truncated_ring_costs_the_event_not_the_agent(shm_dir: Path) -> None:
    """The tenant owns its ring file; writing to a truncated mapping would be SIGBUS."""
    root, regions = shm_dir / "root", shm_dir / "regions"
    regions.mkdir()
    (regions / "r1.yaml").write_text(yaml.safe_dump(manifest()))
    command = local_agent(regions, root, "--no-http", "--drain-grace-seconds", "1")
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert agent.stdout is not None
        lines = []
        while not any("ns1/r1  Ready" in line for line in lines):
            lines.append(agent.stdout.readline())
            assert lines[-1], "".join(lines)
        os.truncate(root / "ns1" / "r1" / EVENTS_RING, 0)
        (regions / "r1.yaml").unlink()
        while not any("ns1/r1  Removed" in line for line in lines):
            lines.append(agent.stdout.readline())
            assert lines[-1], "".join(lines)  # the agent is still alive
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=20)
    finally:
        agent.kill()
    assert agent.returncode == 0, "".join(lines) + out
    assert "event ring was truncated or replaced" in "".join(lines) + out
    assert not (root / "ns1").exists()
