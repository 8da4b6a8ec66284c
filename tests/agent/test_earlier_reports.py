"""A restarted agent and what an earlier process of it left in status.nodes.<node>.

The new process remembers nothing. A region deleted (or placed elsewhere) whose entry still says
this node may hold its files (Failed after a refused creation; Draining when the process stopped
right after removing the files) must end Removed, or the operator waits for it forever; but only
once nothing of the region is on the node."""

from __future__ import annotations

import os
from pathlib import Path

from kvshm.api import NodeRegionPhase
from tests.agent.builders import (
    RecordingNotifier,
    holding,
    make_reconciler,
    region,
    region_dir,
    settle,
    view,
)


def test_a_deleted_region_with_nothing_here_is_reported_removed(shm_dir: Path) -> None:
    r1 = region()
    restarted = make_reconciler(shm_dir / "root")
    result = settle(restarted, view(r1, deleting=(r1.key,), reported=(r1.key,)))
    report = result.reports[r1.key]
    assert report.phase is NodeRegionPhase.REMOVED, report
    assert report.message == "nothing of the region is on this node"
    # nothing is written for a region whose entry already says Removed, or that has none
    assert settle(make_reconciler(shm_dir / "root"), view(r1, deleting=(r1.key,))).reports == {}


def test_what_an_earlier_process_left_of_a_moved_region_is_removed_too(shm_dir: Path) -> None:
    root = shm_dir / "root"
    moved = region(placement={"nodeNames": ["node-b"]})
    directory = region_dir(root)  # the event queue a failed attempt of the last process made
    (directory / RecordingNotifier.FILE).write_bytes(b"\0" * 4096)
    notifier = RecordingNotifier()
    restarted = make_reconciler(root, notifier=notifier)
    result = settle(restarted, view(moved, reported=(moved.key,)))
    report = result.reports[moved.key]
    assert report.phase is NodeRegionPhase.REMOVED, report
    assert report.message == f"nothing of the region is on this node; removed {directory}"
    assert notifier.closed == [moved.key]
    assert not (root / "ns1").exists()


def test_a_file_of_the_region_still_here_is_drained_never_reported_removed(shm_dir: Path) -> None:
    """The region's file hides among more region-shaped names than the inventory lists: the
    restarted agent looks it up by its own name before it says Removed."""
    root = shm_dir / "root"
    r1 = region()
    directory = region_dir(root)
    path = directory / "vllm_offload_r1.mmap"
    path.write_bytes(b"\0" * r1.size_bytes)
    for i in range(100):  # listed before it (a directory is read newest first)
        os.close(os.open(directory / f"vllm_offload_junk{i}.mmap", os.O_CREAT, 0o600))
    restarted = make_reconciler(root, drain_grace_seconds=60)
    deleted = view(r1, deleting=(r1.key,), reported=(r1.key,))
    with holding(path):
        result = restarted.reconcile(deleted)
        assert result.root_scan is not None
        listed = {f.path for f in result.root_scan.inventory.files}
        assert "ns1/r1/vllm_offload_r1.mmap" not in listed  # the inventory did not see it
        for _ in range(3):
            report = result.reports[r1.key]
            assert report.phase is NodeRegionPhase.DRAINING, report
            assert "waiting up to" in report.message
            assert path.exists()
            result = restarted.reconcile(deleted)
    report = settle(restarted, deleted).reports[r1.key]
    assert report.phase is NodeRegionPhase.REMOVED, report
    assert not path.exists()
    assert len(list(directory.iterdir())) == 100  # the other names are not the region's
