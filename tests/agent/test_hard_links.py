"""A tenant's hard link to its region file: flagged while the region lives,
and on removal the region's name goes and the memory the link keeps is counted and reported."""

from __future__ import annotations

import os
from pathlib import Path

from tests.agent.hostile import RunningAgent, tenant, tenant_manifest, traversable, write_regions

_LINK = """
import os, sys
os.link(sys.argv[1], sys.argv[2])
"""


def test_a_hard_link_is_flagged_and_its_memory_reported_on_removal(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = traversable(shm_dir) / "root"
    write_regions(regions, "linked.yaml", tenant_manifest("linked"))
    write_regions(regions, "other.yaml", tenant_manifest("other", "elsewhere"))
    directory = root / "tenant" / "linked"
    region_file = directory / "vllm_offload_linked.mmap"
    with RunningAgent(
        regions, root, "--no-http", "--drain-grace-seconds", "1", "--resync-seconds", "1"
    ) as agent:
        agent.saw("tenant/linked  Ready")
        tenant(_LINK, str(region_file), str(directory / "keep"))
        agent.saw(f"problem: {region_file} is a regular file with 2 links")
        (regions / "linked.yaml").unlink()
        agent.saw("tenant/linked  Removed")
        write_regions(regions, "later.yaml", tenant_manifest("later", "elsewhere"))
        agent.saw("elsewhere/later  Ready")  # the others are served throughout
    removed = next(line for line in agent.lines if "tenant/linked  Removed" in line)
    assert "the region file had 1 more hard link(s) (1 in" in removed and "(keep)" in removed
    assert "keep 2.0 MiB allocated after its removal: remove them" in removed
    assert f"-inum {(directory / 'keep').stat().st_ino}" in removed
    # the region's own name is gone; the tenant's link (and its memory) is what is left
    assert not region_file.exists()
    keep = (directory / "keep").stat()
    assert keep.st_nlink == 1 and keep.st_blocks * 512 >= 2 << 20
    assert os.path.exists(root / "elsewhere" / "other" / "vllm_offload_other.mmap")
