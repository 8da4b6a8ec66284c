"""Executing the operator's reclaims: every condition is checked again at execution time."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from kvshm.agent.reconciler import NodeReconciler
from kvshm.agent.reports import EventReason
from kvshm.api import ReclaimOutcome
from tests.agent.builders import holding, make_reconciler, reclaim, region, settle, view

PATH = "ns1/r1/vllm_offload_r1.mmap"


def orphan(root: Path) -> Path:
    """Leave a Ready region's file behind as an orphan (reclaimPolicy Retain, then gone)."""
    reconciler = make_reconciler(root)
    kept = region(reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    settle(reconciler, view(kept, deleting=("ns1/r1",)))
    path = root / PATH
    assert path.exists()
    return path


def test_an_unclaimed_unheld_file_is_removed_with_its_directories(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    reconciler = make_reconciler(root)
    scan = reconciler.reconcile(view()).root_scan
    assert scan is not None and [f.path for f in scan.inventory.orphans] == [PATH]
    result = reconciler.reconcile(view(reclaims=(reclaim(PATH, 1),)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.DONE
    assert [e.reason for e in result.events] == [EventReason.RECLAIMED]
    assert not path.exists() and not (root / "ns1").exists()
    # executed once: the same request on the next pass is only reported again
    again = reconciler.reconcile(view(reclaims=(reclaim(PATH, 1),)))
    assert again.events == [] and again.reclaims[PATH].outcome is ReclaimOutcome.DONE
    # a request that leaves the spec leaves the status
    assert reconciler.reconcile(view()).reclaims == {}


def orphaned_since(reconciler: NodeReconciler) -> datetime | None:
    scan = reconciler.reconcile(view()).root_scan
    assert scan is not None
    (item,) = [f for f in scan.inventory.files if f.path == PATH]
    return item.orphaned_since


def test_an_orphans_time_starts_when_its_last_holder_leaves_never_earlier(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    reconciler = make_reconciler(root)
    with holding(path):
        assert orphaned_since(reconciler) is None  # unclaimed, but held: not an orphan
        time.sleep(1.1)
        left = datetime.now(UTC)
    since = orphaned_since(reconciler)
    assert since is not None and since >= left and since.microsecond == 0  # rounded up
    time.sleep(1.1)
    assert orphaned_since(reconciler) == since  # kept while it stays an orphan
    with holding(path):
        assert orphaned_since(reconciler) is None
    assert (orphaned_since(reconciler) or since) > since  # a holder started it over


def test_a_held_file_is_kept(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    with holding(path):
        result = make_reconciler(root).reconcile(view(reclaims=(reclaim(PATH),)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_HELD
    assert [e.reason for e in result.events] == [EventReason.RECLAIM_REFUSED]
    assert path.exists()


def test_a_file_mapped_without_flock_is_kept_when_the_proc_scan_is_on(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    with holding(path, "map"):
        result = make_reconciler(root, proc_scan=True).reconcile(view(reclaims=(reclaim(PATH),)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_HELD
    assert path.exists()


def test_a_file_claimed_again_since_the_decision_is_kept(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    # the operator decided on an old inventory; meanwhile a region claims the file again
    request = reclaim(PATH, 1)
    result = make_reconciler(root).reconcile(view(region(), reclaims=(request,)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_CLAIMED
    assert "ns1/r1" in result.reclaims[PATH].message
    assert path.exists()


def test_a_changed_request_is_executed_again(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    reconciler = make_reconciler(root)
    with holding(path):
        first = reconciler.reconcile(view(reclaims=(reclaim(PATH, 1),)))
    assert first.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_HELD
    second = reconciler.reconcile(view(reclaims=(reclaim(PATH, 2),)))
    assert second.reclaims[PATH].outcome is ReclaimOutcome.DONE
    assert not path.exists()


def test_a_file_already_gone_is_done(shm_dir: Path) -> None:
    root = shm_dir / "root"
    result = make_reconciler(root).reconcile(view(reclaims=(reclaim(PATH),)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.DONE
    assert result.reclaims[PATH].message == "already gone"


def test_a_file_whose_size_changed_since_the_decision_is_kept(shm_dir: Path) -> None:
    root = shm_dir / "root"
    path = orphan(root)
    stale = reclaim(PATH, 1, size=path.stat().st_size + 4096)
    result = make_reconciler(root).reconcile(view(reclaims=(stale,)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.REFUSED_CLAIMED
    assert "re-created or resized" in result.reclaims[PATH].message
    assert path.exists()
    exact = reclaim(PATH, 2, size=path.stat().st_size)
    result = make_reconciler(root).reconcile(view(reclaims=(exact,)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.DONE
