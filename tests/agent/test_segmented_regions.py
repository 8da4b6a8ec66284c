"""The agent with vllm-0.33 regions of several files, on a real tmpfs: every file is created,
reported, adopted, held, drained, reclaimed and removed as one region. The regions are sparse
(populate: false, lock: false), so 2.25 GiB costs no memory."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from kvshm.agent.reports import EventReason
from kvshm.api import NodeRegionPhase, OffloadRegion, ReclaimOutcome
from tests.agent.builders import (
    MIB,
    holding,
    make_reconciler,
    reclaim,
    region,
    settle,
    stop_agent,
    view,
)

ROW = 256 * MIB
SIZE = 9 * ROW  # 2.25 GiB: vLLM 0.33 makes 2 files, of 5 rows and of 4 rows
FILE_0 = "vllm_offload_seg.mmap"
FILE_1 = "vllm_offload_seg.mmap.1"
PATH = f"ns1/seg/{FILE_0}"


def segmented(**spec: Any) -> OffloadRegion:
    spec.setdefault("reclaimPolicy", "Delete")
    return region("seg", blocks=9, page=ROW, workers=1, populate=False, lock=False, **spec)


def files(root: Path) -> list[str]:
    directory = root / "ns1" / "seg"
    return (
        sorted(n for n in os.listdir(directory) if n.startswith("vllm_"))
        if directory.exists()
        else []
    )


def inodes(root: Path) -> list[int]:
    return [(root / "ns1" / "seg" / name).stat().st_ino for name in files(root)]


def ready(root: Path, **spec: Any) -> None:
    """The region made Ready by an agent that then stopped."""
    reconciler = make_reconciler(root)
    result = settle(reconciler, view(segmented(**spec)))
    assert result.reports["ns1/seg"].phase is NodeRegionPhase.READY
    stop_agent(reconciler)


def test_every_file_is_created_with_its_size_owner_and_mode_and_reported(shm_dir: Path) -> None:
    root = shm_dir / "root"
    r = segmented(access={"uid": 1234, "gid": 5678, "mode": 0o640})
    result = settle(make_reconciler(root), view(r))
    report = result.reports["ns1/seg"]
    assert report.phase is NodeRegionPhase.READY, report
    assert (report.size_bytes, report.files) == (SIZE, 2)
    assert report.path == str(root / PATH)
    assert report.to_status()["fileCount"] == 2
    assert files(root) == [FILE_0, FILE_1]
    for name, size in ((FILE_0, 5 * ROW), (FILE_1, 4 * ROW)):
        st = (root / "ns1" / "seg" / name).stat()
        assert st.st_size == size
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o640)
        with open(root / "ns1" / "seg" / name, "rb") as probe:  # the agent holds a shared flock
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    scan = make_reconciler(root).reconcile(view(r)).root_scan  # scanned as a pass starts
    assert scan is not None
    inventory = scan.inventory
    [entry] = inventory.files
    assert (entry.path, entry.size_bytes, entry.files) == (PATH, SIZE, 2)
    assert entry.claimed_by == "ns1/seg" and entry.to_status()["fileCount"] == 2


def test_a_restart_adopts_every_file_without_recreating_any(shm_dir: Path) -> None:
    root = shm_dir / "root"
    ready(root)
    before = inodes(root)
    (root / "ns1" / "seg" / FILE_1).write_bytes(b"kv")  # data in file 1 must survive
    os.truncate(root / "ns1" / "seg" / FILE_1, 4 * ROW)
    reconciler = make_reconciler(root)
    first = reconciler.reconcile(view(segmented()))
    assert [e.reason for e in first.events][:1] == [EventReason.ADOPTED]
    result = settle(reconciler, view(segmented()))
    assert result.reports["ns1/seg"].phase is NodeRegionPhase.READY
    assert inodes(root) == before
    assert (root / "ns1" / "seg" / FILE_1).read_bytes()[:2] == b"kv"


def _adopt_fails(root: Path, *words: str) -> None:
    report = settle(make_reconciler(root), view(segmented())).reports["ns1/seg"]
    assert report.phase is NodeRegionPhase.FAILED, report
    for word in words:
        assert word in report.message, report.message


def test_a_missing_file_is_reported_and_nothing_is_created_or_truncated(shm_dir: Path) -> None:
    root = shm_dir / "root"
    ready(root)
    (root / "ns1" / "seg" / FILE_1).unlink()
    before = inodes(root)
    _adopt_fails(root, FILE_1, "is missing")
    assert files(root) == [FILE_0] and inodes(root) == before


def test_a_file_of_another_size_is_reported_and_never_truncated(shm_dir: Path) -> None:
    root = shm_dir / "root"
    ready(root)
    os.truncate(root / "ns1" / "seg" / FILE_1, ROW)
    _adopt_fails(root, FILE_1, f"is {ROW} bytes", f"needs {4 * ROW} bytes")
    assert (root / "ns1" / "seg" / FILE_1).stat().st_size == ROW


def test_a_file_the_layout_does_not_name_is_reported_and_kept(shm_dir: Path) -> None:
    root = shm_dir / "root"
    ready(root)
    (root / "ns1" / "seg" / "vllm_offload_seg.mmap.2").write_bytes(b"x")
    _adopt_fails(root, "vllm_offload_seg.mmap.2", "not one of the 2 files")
    assert len(files(root)) == 3


def test_a_holder_of_any_file_holds_the_region_through_a_drain(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, drain_grace_seconds=60, proc_scan=True)
    settle(reconciler, view(segmented()))
    for name, how in ((FILE_0, "flock"), (FILE_1, "map")):
        with holding(root / "ns1" / "seg" / name, how):
            result = reconciler.reconcile(view())
            assert result.reports["ns1/seg"].phase is NodeRegionPhase.DRAINING, (name, how)
            assert files(root) == [FILE_0, FILE_1]
    result = settle(reconciler, view())
    assert files(root) == [] and not (root / "ns1").exists()


def test_an_orphan_is_all_its_files_and_a_reclaim_removes_them_all(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, proc_scan=True)
    kept = segmented(reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    settle(reconciler, view(kept, deleting=("ns1/seg",)))
    assert files(root) == [FILE_0, FILE_1]
    scan = reconciler.reconcile(view()).root_scan
    assert scan is not None
    inventory = scan.inventory
    [orphan] = inventory.orphans
    assert (orphan.path, orphan.size_bytes, orphan.files) == (PATH, SIZE, 2)
    with holding(root / "ns1" / "seg" / FILE_1, "map"):  # vLLM maps files, takes no flock
        refused = reconciler.reconcile(view(reclaims=(reclaim(PATH, 1, SIZE),)))
    assert refused.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_HELD
    assert files(root) == [FILE_0, FILE_1]
    done = reconciler.reconcile(view(reclaims=(reclaim(PATH, 2, SIZE),)))
    assert done.reclaims[PATH].outcome is ReclaimOutcome.DONE, done.reclaims[PATH]
    assert "2 files" in done.reclaims[PATH].message
    assert not (root / "ns1").exists()


def test_files_left_without_their_file_0_are_an_orphan(shm_dir: Path) -> None:
    root = shm_dir / "root"
    directory = root / "ns1" / "old"
    directory.mkdir(parents=True)
    os.chmod(root, 0o711)
    os.chmod(root / "ns1", 0o711)
    stray = directory / "vllm_offload_gone.mmap.3"
    stray.write_bytes(b"\0" * 4096)
    reconciler = make_reconciler(root)
    scan = reconciler.reconcile(view()).root_scan
    assert scan is not None
    inventory = scan.inventory
    [orphan] = inventory.orphans
    assert (orphan.path, orphan.size_bytes, orphan.files) == (
        "ns1/old/vllm_offload_gone.mmap.3",
        4096,
        1,
    )
    done = reconciler.reconcile(view(reclaims=(reclaim(orphan.path, 1, 4096),)))
    assert done.reclaims[orphan.path].outcome is ReclaimOutcome.DONE
    assert not stray.exists()


def test_a_region_removes_its_ids_leftovers_unless_they_are_held(shm_dir: Path) -> None:
    root = shm_dir / "root"
    ready(root)
    (root / "ns1" / "seg" / FILE_0).unlink()  # file 1 is left, attachable by no one
    leftover = root / "ns1" / "seg" / FILE_1
    with holding(leftover, "flock"):
        report = settle(make_reconciler(root), view(segmented())).reports["ns1/seg"]
        assert report.phase is NodeRegionPhase.FAILED, report
        assert FILE_1 in report.message and "already exists" in report.message
        assert files(root) == [FILE_1]
    time.sleep(0.1)
    result = settle(make_reconciler(root), view(segmented()))
    assert result.reports["ns1/seg"].phase is NodeRegionPhase.READY
    assert files(root) == [FILE_0, FILE_1]


def test_capacity_counts_every_file_and_the_padding(small_tmpfs: Path) -> None:
    root = small_tmpfs / "root"
    result = settle(make_reconciler(root), view(segmented()))
    refused = result.reports["ns1/seg"]
    assert refused.phase is NodeRegionPhase.FAILED
    assert "not enough room" in refused.message and f"({SIZE} bytes)" in refused.message
    assert files(root) == []
    assert not (root / "ns1").exists()  # refused for capacity: not even its directory is made
    # 100 rows of 3000 bytes x 2 workers are 100 padded rows of 8192 bytes, not 600000 bytes
    padded = region("pad", blocks=100, page=3000, workers=2, populate=False)
    assert padded.size_bytes == 100 * 8192
    report = settle(make_reconciler(root), view(padded)).reports["ns1/pad"]
    assert (report.phase, report.size_bytes, report.files) == (NodeRegionPhase.READY, 819200, 1)
    assert (root / "ns1" / "pad" / "vllm_offload_pad.mmap").stat().st_size == 819200
