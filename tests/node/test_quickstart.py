"""README.md's quickstart, its first block run as written on the real node (labelled as the GPU
Operator labels GPU nodes), so the README cannot drift from what works. Its second block needs
a GPU and vLLM's image; test_serving.py runs that wiring with the vLLM container replaced."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.envtest.server import REPO
from tests.node.chart import Release, describe_cluster
from tests.node.node import NODE_NAME, Node
from tests.node.regions import node_report, region_phase, remove_regions

README = REPO / "README.md"
GPU_LABEL = "nvidia.com/gpu.present"
# under the test's own timeout, so that a stuck block says why (the regions, pods and events)
BLOCK_TIMEOUT = 240


def _regions_yaml(node: Node) -> str:
    return node.kubectl("get", "offloadregions,offloadnodes", "-A", "-o", "yaml")[-6000:]


def quickstart_blocks() -> list[str]:
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.DOTALL)


def test_the_readmes_quickstart_runs_as_written(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> None:
    blocks = quickstart_blocks()
    assert len(blocks) == 2, blocks
    node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}=true", "--overwrite")
    env = {
        **node.env(),
        "PATH": f"{REPO / '.tools' / 'bin'}:{os.environ['PATH']}",
        "HELM_CACHE_HOME": str(helm_home / "cache"),
        "HELM_CONFIG_HOME": str(helm_home / "config"),
        "HELM_DATA_HOME": str(helm_home / "data"),
    }
    release = Release(node, helm_home)
    try:
        try:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", blocks[0]], cwd=REPO, env=env,
                capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            stuck = f"{exc.output!r}\n{_regions_yaml(node)}\n{describe_cluster(node)}"
            raise AssertionError(f"the block ran past {BLOCK_TIMEOUT}s: {stuck}") from None
        assert done.returncode == 0, (
            done.stdout[-3000:] + done.stderr[-3000:] + _regions_yaml(node) + describe_cluster(node)
        )
        # the table the README points at: the region Ready on the one GPU node
        header, row = done.stdout.strip().splitlines()[-2:]
        assert header.split()[:5] == ["NAME", "PHASE", "SIZE", "READY", "WANTED"], header
        assert row.split()[:5] == ["llama-8b-kv", "Ready", "8Gi", "1", "1"], row
        assert region_phase(node, "serving", "llama-8b-kv") == "Ready"
        assert node_report(node, "serving", "llama-8b-kv")["locked"] is True
        figures["README quickstart, first block"] = "ran as written: region Ready (8 GiB)"
    finally:
        remove_regions(node)
        release.uninstall()
        node.kubectl("delete", "namespace", "serving", "--wait=false")
        node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}-")
