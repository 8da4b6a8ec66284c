"""The region root on huge pages, as the chart makes it (regionRootMount: kvshm-agent
mount-root in a privileged init container, Bidirectional propagation) on the real node, whose
/dev/shm has shared propagation as on a systemd host.

Enabled over a root that already holds a region, it mounts nothing (that would hide the
region). On an empty root it mounts a huge-page tmpfs the host sees; the agent reports 2 MiB
pages; a region is Ready on huge pages, charged to the agent's cgroup; a pod attaching through
its hostPath maps them as huge pages."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.huge_pages import assert_mapped_huge, fallbacks_since_now
from tests.node.chart import CHART, Release, component, wait
from tests.node.memory import meminfo_bytes, memory_stat, pod_memory_cgroup
from tests.node.node import NODE_NAME, REGION_ROOT, Node
from tests.node.regions import (
    TENANT_ACCESS,
    apply_manifest,
    node_report,
    offload_region,
    region_phase,
    remove_regions,
)

NAMESPACE = "huge"
HUGE_PAGE = 2**21
GIB = 2**30


def _region(name: str) -> dict[str, Any]:
    return offload_region(NAMESPACE, name, 4096, access=TENANT_ACCESS)


def _root_mount() -> str | None:
    """The options of the mount at the region root itself (not /dev/shm's), if any."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(REGION_ROOT):
            return " ".join(fields[5:])
    return None


def _pages(node: Node) -> dict[str, Any]:
    offload_node = json.loads(node.kubectl("get", "offloadnode", NODE_NAME, "-o", "json"))
    pages: dict[str, Any] = (offload_node.get("status") or {}).get("pages") or {}
    return pages


def _agent_uid(release: Release) -> str:
    [agent] = [
        p
        for p in release.pods()
        if component(p) == "agent" and not p["metadata"].get("deletionTimestamp")
    ]
    return str(agent["metadata"]["uid"])


ATTACH = """
import mmap, os, re, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0)
m.madvise(mmap.MADV_HUGEPAGE)
for offset in range(0, len(m), 4096):
    m[offset] = 1
smaps = open("/proc/self/smaps").read()
section = smaps[smaps.index(os.path.basename(path)):]
pmd = re.search(r"ShmemPmdMapped:\\s+(\\d+) kB", section)
print("pmd-mapped", int(pmd.group(1)) * 1024, flush=True)
time.sleep(3600)
"""


def _attacher(name: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "attacher", "namespace": NAMESPACE},
        "spec": {
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
            "containers": [{
                "name": "attach", "image": image, "imagePullPolicy": "Never",
                "command": ["python", "-c", ATTACH, f"/dev/shm/vllm_offload_{name}.mmap"],
                "volumeMounts": [{"name": "region", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "region", "hostPath": {
                "path": f"{REGION_ROOT}/{NAMESPACE}/{name}", "type": "Directory"}}],
        },
    }  # fmt: skip


def test_the_chart_mounts_a_huge_page_root_only_where_it_hides_nothing(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> None:
    release = Release(node, helm_home)
    release.install()
    release.wait_ready()
    node.kubectl("create", "namespace", NAMESPACE)
    try:
        # a region on the plain /dev/shm root, 4 KiB pages
        apply_manifest(node, yaml.safe_dump(_region("small-pages")))
        wait(lambda: region_phase(node, NAMESPACE, "small-pages") == "Ready", 120, "Ready", node)
        assert _root_mount() is None
        wait(lambda: _pages(node).get("sizeBytes") == 4096, 60, "4 KiB pages reported", node)

        # the mount asked for over a root that holds a region: nothing is mounted
        mount = ["--reuse-values", "--set", "regionRootMount.enabled=true", "--wait"]
        release.helm("upgrade", release.name, str(CHART), "-n", release.namespace, *mount)
        release.wait_ready()
        assert _root_mount() is None
        assert region_phase(node, NAMESPACE, "small-pages") == "Ready"
        assert node_report(node, NAMESPACE, "small-pages")["phase"] == "Ready"

        # an empty root: the next agent pod's init container mounts the huge-page tmpfs
        remove_regions(node)
        node.kubectl("delete", "pod", "-n", release.namespace, "-l",
                     "app.kubernetes.io/component=agent")  # fmt: skip
        release.wait_ready()
        options = wait(_root_mount, 60, "the region root's own mount", node)
        assert re.search(r"\btmpfs\b", options) and "huge=within_size" in options, options
        assert "mode=711" in options, options
        wait(lambda: _pages(node).get("sizeBytes") == HUGE_PAGE, 60, "2 MiB pages reported", node)
        before = meminfo_bytes("ShmemHugePages")
        fallbacks = fallbacks_since_now()
        started = time.monotonic()
        apply_manifest(node, yaml.safe_dump(_region("huge-pages")))
        wait(lambda: region_phase(node, NAMESPACE, "huge-pages") == "Ready", 120, "Ready", node)
        figures["OffloadRegion applied to Ready on the huge-page root, 1 GiB"] = (
            f"{time.monotonic() - started:.1f} s"
        )
        grown = meminfo_bytes("ShmemHugePages") - before
        assert grown + fallbacks() * HUGE_PAGE >= GIB, f"ShmemHugePages grew by {grown} bytes"
        charged = memory_stat(pod_memory_cgroup(_agent_uid(release)))["total_shmem"]
        assert charged >= GIB, charged

        # a tenant's pod maps the region's huge pages through its hostPath
        apply_manifest(node, yaml.safe_dump(_attacher("huge-pages", kvshm_image)))
        line = wait(
            lambda: next(
                (x for x in node.kubectl("logs", "-n", NAMESPACE, "attacher").splitlines()
                 if x.startswith("pmd-mapped")), None,
            ),
            120, "the attacher's mapping", node,
        )  # fmt: skip
        pmd_mapped = int(line.split()[1])
        assert_mapped_huge(min(pmd_mapped, GIB), GIB, fallbacks())
        figures["a pod's mapping of a 1 GiB region on the huge-page root"] = (
            f"{pmd_mapped / GIB:.2f} GiB mapped by 2 MiB pages (ShmemPmdMapped)"
        )
    finally:
        node.kubectl("delete", "pod", "attacher", "-n", NAMESPACE, "--ignore-not-found",
                     "--grace-period=1")  # fmt: skip
        remove_regions(node)
        release.uninstall()
        node.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        # the mount outlives the release (docs/uninstall.md); later tests want plain /dev/shm
        if _root_mount() is not None:
            subprocess.run(["umount", str(REGION_ROOT)], check=True)
