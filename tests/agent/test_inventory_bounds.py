"""10,001 region-shaped files in one tenant's directory: the inventory lists
a bounded number, summarises the rest in one problem, and a pass stays fast."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvshm.agent.root.saferoot import MAX_REGION_FILES
from kvshm.agent.view import ClusterView
from kvshm.api import NodeRegionPhase
from tests.agent.builders import make_reconciler, region, settle, view
from tests.agent.hostile import TENANT_UID, tenant, traversable

_FILL = """
import os, sys
os.chdir(sys.argv[1])
for i in range(int(sys.argv[2])):
    os.close(os.open(f"vllm_offload_junk{i}.mmap", os.O_CREAT | os.O_WRONLY, 0o600))
"""


def test_ten_thousand_region_shaped_files_cost_a_bounded_status_and_pass(shm_dir: Path) -> None:
    root = traversable(shm_dir) / "root"
    access = {"uid": TENANT_UID, "gid": TENANT_UID, "mode": 0o600}
    flooder, other = region("flooder", "t1", access=access), region("other", "t2", access=access)
    reconciler = make_reconciler(root)
    settle(reconciler, view(flooder))
    tenant(_FILL, str(root / "t1" / "flooder"), "10001")
    started = time.monotonic()
    result = reconciler.reconcile(view(flooder))
    seconds = time.monotonic() - started
    assert result.root_scan is not None
    files = [f for f in result.root_scan.inventory.files if f.path.startswith("t1/flooder/")]
    assert len(files) == MAX_REGION_FILES
    summary = [p for p in result.root_scan.problems if "holds too many files" in p]
    assert len(summary) == 1 and "entries beyond the first 4096 not looked at" in summary[0]
    status = json.dumps(
        {"files": [f.to_status() for f in result.root_scan.inventory.files], "problems": summary}
    )
    assert len(status) < 32 << 10, len(status)
    assert seconds < 2, seconds
    # other regions are served as before
    result = settle(reconciler, view(flooder, other))
    assert result.reports["t2/other"].phase is NodeRegionPhase.READY


def test_a_directory_just_over_the_listing_bound_says_how_many_more(shm_dir: Path) -> None:
    root = traversable(shm_dir) / "root"
    access = {"uid": TENANT_UID, "gid": TENANT_UID, "mode": 0o600}
    flooder = region("flooder", "t1", access=access)
    reconciler = make_reconciler(root)
    settle(reconciler, view(flooder))
    tenant(_FILL, str(root / "t1" / "flooder"), "100")
    result = reconciler.reconcile(view(flooder))
    assert result.root_scan is not None
    summary = [p for p in result.root_scan.problems if "holds too many files" in p]
    # 100 junk files and the region's own: 64 listed, 37 more
    assert len(summary) == 1 and "and 37 more not listed" in summary[0]
    assert "beyond the first" not in summary[0]


_RETAINED = "vllm_offload_retained-old.mmap"
_SANDWICH = """
import os, sys
os.chdir(sys.argv[1])
def fill(first, count):
    for i in range(first, first + count):
        os.close(os.open(f"vllm_offload_junk{i}.mmap", os.O_CREAT | os.O_WRONLY, 0o600))
fill(0, 100)
with open(sys.argv[2], "wb") as retained:
    retained.write(b"kept" * 1024)
fill(100, 100)
"""


def test_a_retained_file_hidden_by_junk_in_its_directory_is_still_listed(shm_dir: Path) -> None:
    """The operator forgets a spec.retained entry whose file the inventory does not list (and
    would later reclaim the file as an orphan): a tenant's junk names around it, beyond the
    directory's listing bound whichever order the filesystem lists them in, must not hide it."""
    root = traversable(shm_dir) / "root"
    access = {"uid": TENANT_UID, "gid": TENANT_UID, "mode": 0o600}
    flooder = region("flooder", "t1", access=access)
    reconciler = make_reconciler(root)
    settle(reconciler, view(flooder))
    tenant(_SANDWICH, str(root / "t1" / "flooder"), _RETAINED)
    retained = f"t1/flooder/{_RETAINED}"

    def listed(cluster: ClusterView) -> dict[str, int]:
        result = reconciler.reconcile(cluster)
        assert result.root_scan is not None
        return {f.path: f.size_bytes for f in result.root_scan.inventory.files}

    assert retained not in listed(view(flooder))  # the bounded listing alone misses it
    looked_up = frozenset({retained, "t1/flooder/vllm_offload_never-made.mmap", "not/a/path"})
    files = listed(view(flooder, listed_first=looked_up))
    assert files[retained] == 4096
    assert "t1/flooder/vllm_offload_never-made.mmap" not in files
    assert sum(p.startswith("t1/flooder/") for p in files) == MAX_REGION_FILES + 1
