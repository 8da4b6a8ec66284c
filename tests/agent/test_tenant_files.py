"""What a tenant keeps in its region directory (its pod's /dev/shm) besides the region, counted
on a real tmpfs against what it may keep there: the warm-restart index's size and
--tenant-files-bytes. The region's status message and the agent's metrics say when it is more;
the count takes each inode once, never a region file's other name nor a symlink's target, and
looks at a bounded number of entries."""

from __future__ import annotations

import os
from pathlib import Path

from kvshm.agent.metrics import AgentMetrics
from kvshm.agent.reports import PassResult
from kvshm.agent.tenantfiles import MAX_ENTRIES
from kvshm.api import NodeRegionPhase
from kvshm.region.index.format import index_size
from tests.agent.builders import MIB, make_reconciler, region, settle, view

ALLOWANCE = MIB


def other_files(result: PassResult) -> tuple[float | None, float | None]:
    metrics = AgentMetrics("test")
    metrics.observe(result)
    sample = metrics.registry.get_sample_value
    return (
        sample("kvshm_agent_region_other_files_bytes", {"region": "ns1/r1"}),
        sample("kvshm_agent_region_other_files_allowed_bytes", {"region": "ns1/r1"}),
    )


def test_a_tenants_other_files_are_counted_against_what_it_may_keep(shm_dir: Path) -> None:
    root = shm_dir / "root"
    r1 = region("r1", blocks=16, page=65536, workers=2)
    reconciler = make_reconciler(root, tenant_files_bytes=ALLOWANCE)
    result = settle(reconciler, view(r1))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    directory = root / "ns1" / "r1"
    allowed = index_size(16) + ALLOWANCE
    assert other_files(result) == (0, allowed)
    # what the plugin writes: the index, of its size, within what the tenant may keep
    (directory / "vllm_offload_r1.index").write_bytes(b"i" * index_size(16))
    # none of these take memory of their own: another name of the region file, a symlink to
    # a large file elsewhere, a sparse file
    os.link(directory / "vllm_offload_r1.mmap", directory / "keep")
    (shm_dir / "elsewhere").write_bytes(b"e" * (4 * MIB))
    (directory / "link").symlink_to(shm_dir / "elsewhere")
    with open(directory / "sparse", "wb") as sparse:
        sparse.truncate(1 << 30)
    result = reconciler.reconcile(view(r1))
    assert result.reports["ns1/r1"].message == ""
    assert other_files(result) == (index_size(16), allowed)
    # NCCL's or Python's shared memory, in a directory of its own too: over what it may keep
    (directory / "psm_0").write_bytes(b"x" * MIB)
    (directory / "nccl").mkdir()
    (directory / "nccl" / "shm-1").write_bytes(b"y" * MIB)
    result = reconciler.reconcile(view(r1))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.READY
    assert "also holds 2.0 MiB in 4 other file(s) (8.0 KiB of them the warm-restart index)" in (
        report.message
    ), report.message
    assert f"more than the {allowed / MIB:.1f} MiB a tenant may keep" in report.message
    assert other_files(result) == (index_size(16) + 2 * MIB, allowed)
    os.unlink(directory / "psm_0")
    os.unlink(directory / "nccl" / "shm-1")
    assert reconciler.reconcile(view(r1)).reports["ns1/r1"].message == ""


def test_a_directory_of_many_entries_costs_a_bounded_look_and_says_at_least(
    shm_dir: Path,
) -> None:
    root = shm_dir / "root"
    r1 = region("r1", blocks=16, page=65536, workers=2)
    reconciler = make_reconciler(root, tenant_files_bytes=0)
    settle(reconciler, view(r1))
    directory = root / "ns1" / "r1"
    for number in range(3 * MAX_ENTRIES):
        (directory / f"f{number:05}").write_bytes(b"z" * 4096)
    result = reconciler.reconcile(view(r1))
    found = result.tenant_files["ns1/r1"]
    assert not found.complete and found.files <= MAX_ENTRIES
    assert 0 < found.bytes <= MAX_ENTRIES * 4096
    assert "also holds at least" in result.reports["ns1/r1"].message
