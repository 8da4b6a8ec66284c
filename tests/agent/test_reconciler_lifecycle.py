"""The node reconciler on a real tmpfs: create, adopt, refuse, drain, remove."""

from __future__ import annotations

import fcntl
import mmap
import stat
import time
from pathlib import Path

import pytest

from kvshm.agent.reports import EventReason, PassResult
from kvshm.api import NodeRegionPhase
from tests.agent.builders import (
    MIB,
    RecordingNotifier,
    holding,
    leasing,
    make_reconciler,
    region,
    region_dir,
    settle,
    view,
)

SIZE = 16 * 65536 * 2  # builders' default layout: 2 MiB


def reasons(result: PassResult) -> list[EventReason]:
    return [event.reason for event in result.events]


def file_of(root: Path, key: str = "ns1/r1", instance: str = "r1") -> Path:
    return root / key / f"vllm_offload_{instance}.mmap"


def test_create_populates_locks_and_reports_ready(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    r1 = region(access={"uid": 1234, "gid": 5678, "mode": 0o660})
    first = reconciler.reconcile(view(r1))
    assert reasons(first)[0] is EventReason.CREATED
    assert first.reports["ns1/r1"].phase in (
        NodeRegionPhase.CREATING,
        NodeRegionPhase.POPULATING,
        NodeRegionPhase.READY,  # 2 MiB may be done within the pass
    )
    result = settle(reconciler, view(r1))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.READY, report
    assert report.populated_bytes == SIZE and report.locked
    assert report.populate_seconds is not None and report.populate_seconds > 0
    assert EventReason.READY in reasons(first) + reasons(result)
    path = file_of(root)
    assert report.path == str(path)
    st = path.stat()
    assert st.st_size == SIZE and st.st_blocks * 512 >= SIZE
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o660)
    directory = path.parent.stat()
    assert (directory.st_uid, directory.st_gid) == (1234, 5678)
    assert stat.S_IMODE(directory.st_mode) == 0o770  # search bits where the file grants access
    assert stat.S_IMODE((root / "ns1").stat().st_mode) == 0o711
    # the agent holds a shared flock while it hosts the region: attachers take one beside it,
    # and no one can take the file exclusively (to remove it) meanwhile
    with open(path, "rb") as probe:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    with open(path, "rb") as probe, pytest.raises(BlockingIOError):
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # a pass with nothing to do changes nothing and says nothing
    again = reconciler.reconcile(view(r1))
    assert again.events == [] and again.reports == result.reports


def test_progress_is_reported_while_populating(shm_dir: Path) -> None:
    root = shm_dir / "root"
    # 4 chunks of 64 MiB at 128 MiB/s: half a second a chunk
    big = region("big", blocks=256, page=MIB, workers=1, lock=False)
    reconciler = make_reconciler(root, threads=1, rate=128 * MIB)
    seen = set()
    result = reconciler.reconcile(view(big))
    deadline = time.monotonic() + 30
    while result.reports["ns1/big"].phase is not NodeRegionPhase.READY:
        assert time.monotonic() < deadline
        seen.add(result.reports["ns1/big"].populated_bytes)
        time.sleep(0.1)
        result = reconciler.reconcile(view(big))
    partial = {b for b in seen if 0 < b < 256 * MIB}
    assert partial, f"no progress between 0 and the size was reported: {sorted(seen)}"
    assert result.reports["ns1/big"].populated_bytes == 256 * MIB


def test_restart_adopts_the_file_without_recreating_or_zeroing_it(shm_dir: Path) -> None:
    root = shm_dir / "root"
    r1 = region()
    settle(make_reconciler(root), view(r1))
    path = file_of(root)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), SIZE) as m:
        m[100:108] = b"KVBLOCK!"
    inode = path.stat().st_ino
    restarted = make_reconciler(root)  # a new agent process would see the same
    result = settle(restarted, view(r1))
    assert EventReason.ADOPTED in reasons(result) or EventReason.READY in reasons(result)
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert path.stat().st_ino == inode
    assert path.read_bytes()[100:108] == b"KVBLOCK!"


def test_wrong_size_file_is_failed_naming_both_sizes_and_left_untouched(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = region_dir(root) / "vllm_offload_r1.mmap"
    path.write_bytes(b"x" * 12345)
    result = settle(make_reconciler(root), view(region()))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.FAILED
    assert "12345 bytes" in report.message and f"{SIZE} bytes" in report.message
    assert reasons(result) == [EventReason.FAILED]
    assert path.read_bytes() == b"x" * 12345


def test_capacity_refusal_names_the_numbers_and_creates_nothing(small_tmpfs: Path) -> None:
    root = small_tmpfs / "root"
    reconciler = make_reconciler(root, reserve_bytes=16 * MIB)
    # regions are admitted in name order: 32 MiB of 64 with 16 reserved, then 24 more
    fits = region("a-fits", blocks=32, page=MIB, workers=1)
    too_big = region("b-big", blocks=24, page=MIB, workers=1)
    result = settle(reconciler, view(fits, too_big))
    assert result.reports["ns1/a-fits"].phase is NodeRegionPhase.READY
    refused = result.reports["ns1/b-big"]
    assert refused.phase is NodeRegionPhase.FAILED
    assert "not enough room" in refused.message
    assert f"({24 * MIB} bytes)" in refused.message and "16.0 MiB reserved" in refused.message
    assert not (root / "ns1" / "b-big" / "vllm_offload_b-big.mmap").exists()
    # the refusal is retried each pass, but told once
    again = reconciler.reconcile(view(fits, too_big))
    assert again.events == []


def test_sparse_regions_count_as_committed(small_tmpfs: Path) -> None:
    root = small_tmpfs / "root"
    reconciler = make_reconciler(root)
    sparse = region("a-sparse", blocks=40, page=MIB, workers=1, populate=False, lock=False)
    other = region("b-other", blocks=30, page=MIB, workers=1)
    result = settle(reconciler, view(sparse, other))
    assert result.reports["ns1/a-sparse"].phase is NodeRegionPhase.READY
    assert result.reports["ns1/a-sparse"].populated_bytes == 0
    # 64 MiB tmpfs, 40 MiB promised to the sparse region: 30 more would overcommit
    assert result.reports["ns1/b-other"].phase is NodeRegionPhase.FAILED


def test_placement_change_drains_and_removes(shm_dir: Path) -> None:
    root = shm_dir / "root"
    notifier = RecordingNotifier()
    reconciler = make_reconciler(root, notifier=notifier)
    here = region(placement={"nodeNames": ["node-a"]})
    settle(reconciler, view(here))
    elsewhere = region(placement={"nodeNames": ["node-b"]})
    result = settle(reconciler, view(elsewhere))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.REMOVED, report
    assert EventReason.DRAINED in reasons(result)
    assert [key for key, _ in notifier.events] == ["ns1/r1"]
    assert "no longer placed on node node-a" in notifier.events[0][1].reason
    assert not (root / "ns1").exists()  # the file, the notifier's file and both directories


def test_drain_waits_for_a_holder_then_removes_when_it_detaches(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, drain_grace_seconds=60)
    r1 = region()
    settle(reconciler, view(r1))
    with holding(file_of(root)):
        result = reconciler.reconcile(view())
        assert result.reports["ns1/r1"].phase is NodeRegionPhase.DRAINING
        assert "waiting up to" in result.reports["ns1/r1"].message
        assert file_of(root).exists() and not result.settled
    result = settle(reconciler, view())
    assert result.reports == {} or result.reports["ns1/r1"].phase is NodeRegionPhase.REMOVED
    assert not file_of(root).exists()


def test_grace_period_ends_the_wait_for_a_holder(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, drain_grace_seconds=0.5)
    r1 = region()
    settle(reconciler, view(r1))
    with holding(file_of(root)):
        first = reconciler.reconcile(view(r1, deleting=("ns1/r1",)))
        assert first.reports["ns1/r1"].phase is NodeRegionPhase.DRAINING
        time.sleep(0.6)
        result = reconciler.reconcile(view(r1, deleting=("ns1/r1",)))
        report = result.reports["ns1/r1"]
        assert report.phase is NodeRegionPhase.REMOVED
        assert "grace period ended" in report.message
        assert not file_of(root).exists()


def test_a_lease_on_the_file_is_a_holder_the_grace_period_decides_on(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, drain_grace_seconds=1.5)
    r1 = region()
    deleted = view(r1, deleting=("ns1/r1",))
    settle(reconciler, view(r1))
    with leasing(file_of(root)) as leaser:
        first = reconciler.reconcile(deleted)  # the agent lets go: the lease can be taken
        assert first.reports["ns1/r1"].phase is NodeRegionPhase.DRAINING
        assert leaser.stdout is not None and leaser.stdout.readline().strip() == "leased"
        report = reconciler.reconcile(deleted).reports["ns1/r1"]
        assert report.phase is NodeRegionPhase.DRAINING
        assert "waiting up to" in report.message, report.message
        time.sleep(1.6)
        report = reconciler.reconcile(deleted).reports["ns1/r1"]
        assert report.phase is NodeRegionPhase.REMOVED, report.message
        assert "grace period ended" in report.message
        assert not file_of(root).exists()


def test_retain_policy_lets_go_and_keeps_the_file(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    kept = region(reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    result = settle(reconciler, view(kept, deleting=("ns1/r1",)))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.REMOVED
    assert "reclaimPolicy: Retain" in result.reports["ns1/r1"].message
    assert file_of(root).exists()
    gone = reconciler.reconcile(view())
    assert gone.root_scan is not None
    assert [f.claimed_by for f in gone.root_scan.inventory.files] == [""]  # now an orphan


def test_instance_id_change_drains_the_old_file_and_creates_the_new(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region(instanceId="old")))
    result = settle(reconciler, view(region(instanceId="new")))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert not file_of(root, instance="old").exists()
    assert file_of(root, instance="new").exists()


def test_layout_change_of_a_live_region_fails_without_truncating(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    result = settle(reconciler, view(region(blocks=32)))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.FAILED
    assert f"{2 * SIZE} bytes" in report.message and f"{SIZE} bytes" in report.message
    assert file_of(root).stat().st_size == SIZE


def test_a_file_removed_behind_the_agents_back_is_created_again(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    file_of(root).unlink()
    result = settle(reconciler, view(region()))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert file_of(root).stat().st_size == SIZE


def test_an_invalid_spec_keeps_the_existing_region(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    broken = view(invalid={"ns1/r1": "spec.layout.numBlocks must be at least 1"})
    result = reconciler.reconcile(broken)
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.READY
    assert "spec refused" in report.message
    assert file_of(root).exists()


def test_regions_populate_one_at_a_time_and_the_rest_wait_pending(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root, threads=1, rate=64 * MIB)  # 64 MiB: about 1 s each
    first = region("a-first", blocks=64, page=MIB, workers=1, lock=False)
    second = region("b-second", blocks=64, page=MIB, workers=1, lock=False)
    result = reconciler.reconcile(view(first, second))
    deadline = time.monotonic() + 20
    opening = (NodeRegionPhase.CREATING, NodeRegionPhase.POPULATING)
    while result.reports["ns1/a-first"].phase not in opening:
        assert time.monotonic() < deadline
        time.sleep(0.05)
        result = reconciler.reconcile(view(first, second))
    waiting = result.reports["ns1/b-second"]
    assert waiting.phase is NodeRegionPhase.PENDING
    assert "waiting for other regions" in waiting.message
    assert not file_of(root, "ns1/b-second", "b-second").exists()
    result = settle(reconciler, view(first, second), passes=200)
    assert {r.phase for r in result.reports.values()} == {NodeRegionPhase.READY}
