"""Attempts to open a region that fail in the opening thread, and what they leave.

The failure is real: the tenant owns file 0 from the moment the agent gives it its owner, before
the agent maps and populates it, and truncates it. Every such attempt must fail as an attempt
(its half-made file removed, retried), never leave the region Creating with a file no one
removes; and a failed region that is then deleted leaves nothing behind (its event queue made
before the attempt included)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshm.agent.drain.eventwriter import IsolatedEventQueues
from kvshm.agent.hosting import HostingSettings
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.api import NodeRegionPhase, NodeReport, OffloadRegion, parse_offload_region
from kvshm.region.drain_event import EVENTS_RING
from tests.agent.builders import MIB, make_reconciler, settle, view
from tests.agent.hostile import tenant_manifest, tenant_process, traversable

# Truncates the file to nothing over and over, from the moment the agent gives it to the
# tenant; stopped once the agent's attempt is over (a slow populate keeps the file from being
# Ready meanwhile: truncating a Ready region is another story).
_TRUNCATE_FOREVER = """
import os, sys
print("ready", flush=True)
while True:
    try:
        os.truncate(sys.argv[1], 0)
    except OSError:
        pass
"""

# two populate chunks of 64 MiB half a second apart: the file stays partly allocated
SLOW = HostingSettings(populate_threads=1, populate_bytes_per_second=128 * MIB)


def slow_region(name: str, **spec: Any) -> OffloadRegion:
    return parse_offload_region(
        tenant_manifest(name, "ns1", blocks=128, page=MIB, workers=1, lock=False, **spec)
    )


def file_0(root: Path, region: OffloadRegion) -> Path:
    return root / "ns1" / region.name / f"vllm_offload_{region.name}.mmap"


def attempt_truncated(
    reconciler: NodeReconciler, root: Path, regions: list[OffloadRegion]
) -> NodeReport:
    """One pass that starts opening the last of `regions` while the tenant truncates its file,
    and the pass that takes the attempt's outcome in: that region's report."""
    truncater = tenant_process(_TRUNCATE_FOREVER, str(file_0(root, regions[-1])))
    try:
        assert truncater.stdout is not None and truncater.stdout.readline().strip() == "ready"
        reconciler.reconcile(view(*regions))
        reconciler.wait_idle(30)
    finally:
        truncater.kill()
        truncater.wait()
    return reconciler.reconcile(view(*regions)).reports[regions[-1].key]


def test_truncating_the_file_while_it_is_created_fails_the_attempt_and_is_retried(
    shm_dir: Path,
) -> None:
    root = traversable(shm_dir) / "root"
    reconciler = make_reconciler(root, threads=1, rate=128 * MIB, retry_seconds=0.0)
    regions = [slow_region(f"r{i}") for i in range(3)]
    for index, each in enumerate(regions):
        report = attempt_truncated(reconciler, root, regions[: index + 1])
        assert report.phase is NodeRegionPhase.FAILED, report
        # told as a truncation (not as a full tmpfs), and the half-made file went with it
        assert f"{file_0(root, each)} changed size" in report.message, report.message
        assert "truncated or grew it" in report.message, report.message
        assert "the partial files were removed" in report.message, report.message
    # the tenant let them be: every region is created again and Ready, nothing else left
    result = settle(reconciler, view(*regions))
    for each in regions:
        report = result.reports[each.key]
        assert report.phase is NodeRegionPhase.READY, (each.key, report.message)
        directory = root / "ns1" / each.name
        assert [(p.name, p.stat().st_size) for p in directory.iterdir()] == [
            (file_0(root, each).name, each.size_bytes)
        ]


@pytest.fixture
def event_queues() -> Iterator[IsolatedEventQueues]:
    """The agent's own notifier: a ring per region directory, written by a child process."""
    queues = IsolatedEventQueues()
    try:
        yield queues
    finally:
        queues.shutdown()


def descriptors_of(pid: int | None, directory: Path) -> list[str]:
    """What the process has open or mapped in or of `directory`."""
    assert pid is not None
    opened = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            opened.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    mapped = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [p for p in [*opened, *mapped] if str(directory) in p]


def test_a_failed_region_deleted_or_moved_leaves_no_event_queue_directory_or_descriptor(
    shm_dir: Path, event_queues: IsolatedEventQueues
) -> None:
    root = traversable(shm_dir) / "root"
    reconciler = NodeReconciler(
        RegionRoot(str(root)),
        event_queues,
        ReconcilerSettings(hosting=SLOW),  # no retry within the test
        holds=HoldChecker(),
    )
    deleted, moved = slow_region("deleted"), slow_region("moved")
    for regions in ([deleted], [deleted, moved]):
        report = attempt_truncated(reconciler, root, regions)
        assert report.phase is NodeRegionPhase.FAILED, report
    for each in (deleted, moved):
        directory = root / "ns1" / each.name
        # the attempts failed after the event queue was made: it is all that is left
        assert [p.name for p in directory.iterdir()] == [EVENTS_RING]
        assert descriptors_of(os.getpid(), directory)  # the agent's hold on the directory
        assert descriptors_of(event_queues.writer_pid, directory)  # the writer's ring
    elsewhere = slow_region("moved", placement={"nodeNames": ["node-b"]})
    result = reconciler.reconcile(view(deleted, elsewhere, deleting=(deleted.key,)))
    for each in (deleted, moved):
        report = result.reports[each.key]
        assert report.phase is NodeRegionPhase.REMOVED, report
        assert "nothing of the region is on this node" in report.message, report.message
        directory = root / "ns1" / each.name
        assert not directory.exists()
        assert descriptors_of(os.getpid(), directory) == []
        assert descriptors_of(event_queues.writer_pid, directory) == []
    assert not (root / "ns1").exists()
