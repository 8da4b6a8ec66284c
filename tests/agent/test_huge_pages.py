"""The agent on a region root with huge pages, real tmpfs mounts: the root's pages found by
making a file (OffloadNode status.pages, the metric, the banner), --huge-pages refusing or
warning, regions populated on huge pages, and capacity counting what the root allocates."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvshm.agent.reconciler import NodeReconciler
from kvshm.agent.reports import AgentEvent, EventReason, PassResult
from kvshm.agent.root.rootpages import probe_pages
from kvshm.agent.view import ClusterView
from kvshm.api import HugePages, NodeRegionPhase, ReclaimOutcome, RootPages
from kvshm.region import RegionLayout, SharedOffloadRegion, memory
from tests.agent.builders import (
    MIB,
    holding,
    local_agent,
    make_reconciler,
    manifest,
    reclaim,
    region,
    settle,
    view,
)
from tests.agent.cluster import REPO
from tests.conftest import mounted_tmpfs
from tests.huge_pages import assert_mapped_huge

HUGE = memory.HUGE_PAGE_SIZE


def probe(directory: Path) -> RootPages:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return probe_pages(fd, str(directory))
    finally:
        os.close(fd)


def test_a_huge_page_root_is_found_so_and_the_probe_leaves_nothing(huge_tmpfs: Path) -> None:
    free = os.statvfs(huge_tmpfs).f_bfree
    assert probe(huge_tmpfs) == RootPages(HUGE, HugePages.WITHIN_SIZE, rounds_up=False)
    assert os.listdir(huge_tmpfs) == [] and os.statvfs(huge_tmpfs).f_bfree == free


def test_a_root_without_huge_pages_is_found_so(small_tmpfs: Path) -> None:
    assert probe(small_tmpfs) == RootPages(memory.PAGE_SIZE, HugePages.NEVER)


def test_huge_always_rounds_up_exactly_when_a_real_file_does() -> None:
    """Whether a file's last, partial huge page takes a whole one depends on the kernel
    (older ones round huge=always files up): the probe says what this kernel does."""
    with mounted_tmpfs("size=64m,huge=always") as directory:
        found = probe(directory)
        assert (found.size_bytes, found.huge) == (HUGE, HugePages.ALWAYS)
        with SharedOffloadRegion(
            "t", RegionLayout(3, MIB, 1), directory=str(directory), mode="create"
        ) as region:
            rounded = region.allocated_bytes() > region.layout.size_bytes
        assert found.rounds_up == rounded


def settled_events(
    reconciler: NodeReconciler, cluster: ClusterView, passes: int = 50
) -> tuple[PassResult, list[AgentEvent]]:
    """settle(), keeping the events of every pass."""
    events: list[AgentEvent] = []
    for _ in range(passes):
        result = reconciler.reconcile(cluster)
        events += result.events
        if result.settled:
            return result, events
        reconciler.wait_idle(10)
    raise AssertionError(f"not settled after {passes} passes")


def ready_messages(events: list[AgentEvent]) -> list[str]:
    return [event.message for event in events if event.reason is EventReason.READY]


def agent_once(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    regions = root.parent / f"{root.name}-regions"
    regions.mkdir(exist_ok=True)
    (regions / "r.yaml").write_text(yaml.safe_dump(manifest("small", "default")))
    return subprocess.run(
        local_agent(regions, root, "--once", "--no-http", *extra),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_require_refuses_a_root_without_huge_pages_saying_how_to_mount_one(
    small_tmpfs: Path,
) -> None:
    root = small_tmpfs / "kvshm"
    done = agent_once(root, "--huge-pages", "require")
    assert done.returncode == 2, done.stdout + done.stderr
    for part in (
        f"--huge-pages require: the region root {root} gives region files 4 KiB pages "
        "(huge=never), not 2 MiB huge pages",
        f"Mount a tmpfs with huge=within_size at {root}",
        "regionRootMount",
    ):
        assert part in done.stderr, done.stderr
    assert not list(root.iterdir())  # nothing made


@pytest.mark.parametrize(("mode", "warned"), [("warn", True), ("ignore", False)])
def test_warn_warns_and_ignore_says_nothing_and_both_serve(
    small_tmpfs: Path, mode: str, warned: bool
) -> None:
    done = agent_once(small_tmpfs / "kvshm", "--huge-pages", mode)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("not 2 MiB huge pages" in done.stderr) == warned, done.stderr
    assert "default/small  Ready" in done.stdout
    assert "root " in done.stdout and "4 KiB pages (huge=never)" in done.stdout


def test_require_starts_on_a_huge_page_root_and_says_so(huge_tmpfs: Path) -> None:
    done = agent_once(huge_tmpfs / "kvshm", "--huge-pages", "require")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(2 MiB pages (huge=within_size)), node" in done.stdout  # the banner
    assert "default/small  Ready" in done.stdout
    assert "not 2 MiB huge pages" not in done.stderr


def test_a_region_the_agent_makes_on_a_huge_page_root_is_on_huge_pages(
    huge_tmpfs: Path, thp_fallbacks: Callable[[], int]
) -> None:
    root = huge_tmpfs / "kvshm"
    reconciler = make_reconciler(root)
    r1 = region(blocks=8, page=2 * MIB, workers=2)  # 32 MiB, one file of whole huge pages
    result, events = settled_events(reconciler, view(r1))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert result.root_scan is not None
    assert result.root_scan.inventory.pages == RootPages(HUGE, HugePages.WITHIN_SIZE)
    [ready] = ready_messages(events)
    assert "32.0 MiB on 2 MiB pages (huge=within_size)" in ready, ready
    # the pages are huge in the file itself: an attacher maps them whole
    with SharedOffloadRegion(
        "r1", r1.layout, directory=str(root / "ns1" / "r1"), mode="attach", populate=False
    ) as mine:
        memory.madvise(mine.address, r1.size_bytes, memory.MADV_POPULATE_WRITE)
        mapped = memory.huge_mapped_bytes(mine.address, r1.size_bytes)
        assert_mapped_huge(mapped, r1.size_bytes, thp_fallbacks())


def test_the_ready_message_says_what_a_layout_of_odd_files_leaves_on_small_pages(
    huge_tmpfs: Path,
) -> None:
    reconciler = make_reconciler(huge_tmpfs / "kvshm")
    odd = region(blocks=5, page=3 * MIB // 2, workers=1)  # 7.5 MiB: 3 huge pages and 1.5 MiB
    result, events = settled_events(reconciler, view(odd))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    [ready] = ready_messages(events)
    assert "6.0 MiB on 2 MiB pages" in ready, ready
    assert "1.5 MiB can only have small pages" in ready and "kvshm layout --huge-pages" in ready


@pytest.mark.parametrize(("rounds_up", "admitted"), [(False, True), (True, False)])
def test_capacity_counts_the_huge_page_a_rounding_root_takes_for_each_files_tail(
    small_tmpfs: Path, rounds_up: bool, admitted: bool
) -> None:
    """A root that rounds each file's last huge page up holds 32 MiB for a region of 31 MiB;
    with 31.5 MiB available it is refused up front, with the numbers, instead of failing its
    populate. This kernel never rounds (the probe says so), so the root's pages are set."""
    root = small_tmpfs / "kvshm"
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    reconciler = make_reconciler(root, reserve_bytes=free - 63 * MIB // 2)
    reconciler.root.pages = RootPages(HUGE, HugePages.ALWAYS, rounds_up=rounds_up)
    r1 = region(blocks=31, page=MIB, workers=1)
    report = settle(reconciler, view(r1)).reports["ns1/r1"]
    if admitted:
        assert report.phase is NodeRegionPhase.READY, report
    else:
        assert report.phase is NodeRegionPhase.FAILED, report
        assert f"the region needs 32.0 MiB ({32 * MIB} bytes)" in report.message, report.message
        assert not (root / "ns1" / "r1" / "vllm_offload_r1.mmap").exists()


def tmpfs_used(directory: Path) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_drain_waits_for_a_holder_and_removal_frees_the_huge_pages(huge_tmpfs: Path) -> None:
    root = huge_tmpfs / "kvshm"
    reconciler = make_reconciler(root, drain_grace_seconds=60)
    r1 = region(blocks=8, page=2 * MIB, workers=2)
    assert settle(reconciler, view(r1)).reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert tmpfs_used(huge_tmpfs) >= r1.size_bytes
    path = root / "ns1" / "r1" / "vllm_offload_r1.mmap"
    with holding(path):
        draining = reconciler.reconcile(view(r1, deleting=("ns1/r1",)))
        assert draining.reports["ns1/r1"].phase is NodeRegionPhase.DRAINING
        assert path.exists()
    removed = settle(reconciler, view(r1, deleting=("ns1/r1",))).reports["ns1/r1"]
    assert removed.phase is NodeRegionPhase.REMOVED and not path.exists()
    assert tmpfs_used(huge_tmpfs) < MIB  # every huge page given back


def test_an_orphan_on_huge_pages_is_reclaimed_and_its_memory_freed(huge_tmpfs: Path) -> None:
    root = huge_tmpfs / "kvshm"
    reconciler = make_reconciler(root)
    kept = region(blocks=8, page=2 * MIB, workers=2, reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    settle(reconciler, view(kept, deleting=("ns1/r1",)))
    assert tmpfs_used(huge_tmpfs) >= kept.size_bytes  # retained: an orphan, still allocated
    orphan_path = "ns1/r1/vllm_offload_r1.mmap"
    result = make_reconciler(root).reconcile(view(reclaims=(reclaim(orphan_path, 1),)))
    assert result.reclaims[orphan_path].outcome is ReclaimOutcome.DONE
    assert tmpfs_used(huge_tmpfs) < MIB


def test_a_tenant_truncating_a_ready_region_on_huge_pages_makes_it_failed_never_ready(
    huge_tmpfs: Path,
) -> None:
    root = huge_tmpfs / "kvshm"
    reconciler = make_reconciler(root)
    r1 = region(blocks=8, page=2 * MIB, workers=2)
    assert settle(reconciler, view(r1)).reports["ns1/r1"].phase is NodeRegionPhase.READY
    path = root / "ns1" / "r1" / "vllm_offload_r1.mmap"
    os.truncate(path, 3 * MIB)  # the tenant owns the file: it can, splitting a huge page
    report = settle(reconciler, view(r1)).reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.FAILED, report
    assert f"is {3 * MIB} bytes" in report.message and f"needs {r1.size_bytes}" in report.message
    assert path.stat().st_size == 3 * MIB  # never truncated back or re-created over it
