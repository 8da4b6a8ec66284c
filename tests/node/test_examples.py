"""The OffloadRegions of examples/, applied with kubectl as they are, on the real node labelled
as a GPU node: each goes Ready with its files on the node's tmpfs, owned and moded as its spec
says; the one too large for this node (64 GiB) fails with a message that says so, and leaves
nothing half-made."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from kvshm.region import RegionLayout
from tests.envtest.server import REPO
from tests.node.chart import Release, wait
from tests.node.node import NODE_NAME, Node
from tests.node.regions import apply_manifest, region, region_phase, remove_regions
from tests.node.serving import apply_namespace

EXAMPLES = REPO / "examples"
FITTING = [
    EXAMPLES / "regions" / "demo.yaml",
    EXAMPLES / "serving" / "data-parallel" / "offloadregions.yaml",
]
TOO_LARGE = EXAMPLES / "serving" / "offloadregion.yaml"
ROOT = Path("/dev/shm/kvshm")
GPU_LABEL = "nvidia.com/gpu.present"


def _regions(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _files(manifest: dict[str, Any]) -> list[Path]:
    spec = manifest["spec"]
    layout = spec["layout"]
    region_layout = RegionLayout(
        layout["numBlocks"], layout["cpuPageSize"], layout["numWorkers"],
        layout.get("format", "vllm-0.33"), replicated=layout.get("replicated", False),
    )  # fmt: skip
    directory = ROOT / manifest["metadata"]["namespace"] / manifest["metadata"]["name"]
    return [directory / f.name for f in region_layout.files(spec["instanceId"])]


def test_the_examples_regions_go_ready_as_their_specs_say(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> None:
    release = Release(node, helm_home)
    node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}=true", "--overwrite")
    release.install()
    release.wait_ready()
    try:
        apply_namespace(node)
        manifests = [m for path in FITTING for m in _regions(path)]
        for path in [*FITTING, TOO_LARGE]:
            apply_manifest(node, path.read_text())
        for manifest in manifests:
            namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
            wait(lambda n=namespace, m=name: region_phase(node, n, m) == "Ready", 300, name, node)
            access = {"uid": 0, "gid": 0, "mode": 0o600, **manifest["spec"].get("access", {})}
            files = _files(manifest)
            for path in files:
                info = os.lstat(path)
                assert stat.S_ISREG(info.st_mode) and info.st_nlink == 1, path
                assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (
                    access["uid"], access["gid"], access["mode"],
                ), path  # fmt: skip
                assert info.st_blocks * 512 >= info.st_size, f"{path} not populated"
            directory = os.lstat(files[0].parent)
            assert (directory.st_uid, stat.S_IMODE(directory.st_mode) & 0o007) == (
                access["uid"], 0,
            )  # fmt: skip

        [large] = _regions(TOO_LARGE)
        namespace, name = large["metadata"]["namespace"], large["metadata"]["name"]
        failed = wait(
            lambda: (r := region(node, namespace, name)) and (r.get("status") or {}).get("phase")
            in ("Failed", "Pending") and (r.get("status") or {}).get("message") and r,
            120, "the 64 GiB region refused", node,
        )  # fmt: skip
        message = failed["status"]["message"]
        figures["the 64 GiB example on this node"] = f"{failed['status']['phase']}: {message}"
        assert "68718428160" in message or "64" in message, message
        assert not any(p.exists() for p in _files(large)), "a half-made file is left"
    finally:
        remove_regions(node)
        release.uninstall()
        node.kubectl("delete", "namespace", "serving", "--wait=false")
        node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}-")
