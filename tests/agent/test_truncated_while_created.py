"""A tenant truncating its region file while the agent creates it: the tenant owns file 0 from
the moment the agent gives it its owner, before the agent maps and populates it. Every such
attempt must fail as an attempt, saying what happened (its half-made file removed, retried),
never leave the region Creating with a file no one removes."""

from __future__ import annotations

from pathlib import Path

from kvshm.api import NodeRegionPhase, parse_offload_region
from tests.agent.builders import MIB, make_reconciler, settle, view
from tests.agent.hostile import tenant_manifest, tenant_process, traversable

# Truncates the file to nothing over and over, from the moment the agent gives it to the
# tenant; the test stops it once the agent's attempt is over (a slow populate keeps the file
# from being Ready while it runs: truncating a Ready region is another story).
_TRUNCATE_FOREVER = """
import os, sys
print("ready", flush=True)
while True:
    try:
        os.truncate(sys.argv[1], 0)
    except OSError:
        pass
"""

ATTEMPTS = 3


def test_truncating_the_file_while_it_is_created_fails_the_attempt_and_is_retried(
    shm_dir: Path,
) -> None:
    root = traversable(shm_dir) / "root"
    # two populate chunks of 64 MiB half a second apart: the file stays partly allocated
    reconciler = make_reconciler(root, threads=1, rate=128 * MIB, retry_seconds=0.0)
    regions = [
        parse_offload_region(
            tenant_manifest(f"r{i}", "ns1", blocks=128, page=MIB, workers=1, lock=False)
        )
        for i in range(ATTEMPTS)
    ]
    for index, each in enumerate(regions):
        path = root / "ns1" / each.name / f"vllm_offload_{each.name}.mmap"
        truncater = tenant_process(_TRUNCATE_FOREVER, str(path))
        try:
            assert truncater.stdout is not None and truncater.stdout.readline().strip() == "ready"
            reconciler.reconcile(view(*regions[: index + 1]))
            reconciler.wait_idle(30)
        finally:
            truncater.kill()
            truncater.wait()
        # the attempt's outcome is taken in on this pass (and the retry starts)
        report = reconciler.reconcile(view(*regions[: index + 1])).reports[each.key]
        assert report.phase is NodeRegionPhase.FAILED, report
        # told as a truncation (not as a full tmpfs), and the half-made file went with it
        assert f"{path} changed size" in report.message, report.message
        assert "truncated or grew it" in report.message, report.message
        assert "the partial files were removed" in report.message, report.message
    # the tenant let them be: every region is created again and Ready, nothing else left
    result = settle(reconciler, view(*regions))
    for each in regions:
        report = result.reports[each.key]
        assert report.phase is NodeRegionPhase.READY, (each.key, report.message)
        directory = root / "ns1" / each.name
        assert [(p.name, p.stat().st_size) for p in directory.iterdir()] == [
            (f"vllm_offload_{each.name}.mmap", each.size_bytes)
        ]
