"""The protections against a hostile tenant on every file of a multi-file (vllm-0.33) region, on a
real tmpfs: a truncated later file is no longer Ready, a hard link to a later file is flagged
and its memory reported when the region is removed, and the descriptor budget counts a region's
files."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from kvshm.agent.root.descriptors import DescriptorBudget, open_descriptors
from kvshm.api import NodeRegionPhase
from tests.agent.builders import make_reconciler, settle, view
from tests.agent.test_segmented_regions import FILE_0, FILE_1, ROW, files, segmented


def test_a_truncated_later_file_is_no_longer_reported_ready(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    assert settle(reconciler, view(segmented())).reports["ns1/seg"].phase is NodeRegionPhase.READY
    os.truncate(root / "ns1" / "seg" / FILE_1, ROW)  # file 1 needs 4 rows
    report = settle(reconciler, view(segmented())).reports["ns1/seg"]
    assert report.phase is NodeRegionPhase.FAILED, report
    assert FILE_1 in report.message and f"is {ROW} bytes" in report.message, report.message
    assert f"needs {4 * ROW} bytes" in report.message
    assert (root / "ns1" / "seg" / FILE_1).stat().st_size == ROW  # never truncated back


def test_a_hard_link_to_a_later_file_is_flagged_and_its_memory_reported(shm_dir: Path) -> None:
    root = shm_dir / "root"
    directory = root / "ns1" / "seg"
    reconciler = make_reconciler(root)
    settle(reconciler, view(segmented()))
    with open(directory / FILE_1, "r+b") as file_1:  # 1 MiB of file 1 allocated
        file_1.write(b"x" * (1 << 20))
    os.link(directory / FILE_1, directory / "keep")
    scan = reconciler.reconcile(view(segmented())).root_scan
    assert scan is not None
    assert any(f"{FILE_1} is a regular file with 2 links" in p for p in scan.problems)
    result = settle(reconciler, view(segmented(), deleting=("ns1/seg",)))
    removed = result.reports["ns1/seg"]
    assert removed.phase is NodeRegionPhase.REMOVED, removed
    assert f"the region's file {FILE_1} had 1 more hard link(s) (1 in" in removed.message
    assert "(keep)" in removed.message and "keep 1.0 MiB allocated" in removed.message
    assert f"-inum {(directory / 'keep').stat().st_ino}" in removed.message
    # every name of the region is gone; the tenant's link (and its memory) is what is left
    assert files(root) == [] and FILE_0 not in os.listdir(directory)
    keep = (directory / "keep").stat()
    assert keep.st_nlink == 1 and keep.st_blocks * 512 >= 1 << 20


def test_the_descriptor_budget_counts_a_regions_files() -> None:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert limit != resource.RLIM_INFINITY
    # room for exactly one more descriptor than a one-file region takes (reserve 0)
    budget = DescriptorBudget(per_region=limit - open_descriptors() - 1, reserve=0)
    assert budget.needed(3) == budget.needed(1) + 2
    assert budget.refusal(1) is None and budget.refusal(2) is None
    refusal = budget.refusal(3)
    assert refusal is not None and "this region takes about" in refusal
