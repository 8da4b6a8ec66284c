"""examples/serving on the node, with its vLLM container replaced by tests/node/serving_worker.py
(vLLM 0.33's own region code, or kvshm's plugin attach, in the serving image): the one-region
example (deployment.yaml) and the data-parallel one (one stand-in per engine, in one container).

What is kept from the example: the namespace, the init container and its script, the volumes
and mounts of the region, the securityContexts and uid, the anti-affinity, the rollout
strategy, the node selector and tolerations, the labels. What changes, and why:
- the vLLM container's image, command and arguments: the stand-in runs no model;
- its resources: no nvidia.com/gpu on this node, and a 2-core node cannot grant 8 CPUs;
- the models PVC becomes an emptyDir: this node has no storage provisioner, the stand-in loads
  no model;
- the one-region example's numBlocks: its 64 GiB does not fit this node; 512 rows of the same
  5 MiB stride (2.5 GiB) keep it split over two files, as vLLM 0.33 splits it (the
  data-parallel example's two 4 GiB regions are kept as shipped);
- two volumes for the stand-in: its script (a ConfigMap) and /sync (its ranks' barrier).
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from kvshm.region import RegionLayout
from tests.envtest.server import REPO
from tests.node.chart import wait
from tests.node.node import Node
from tests.node.regions import apply_manifest

EXAMPLE = REPO / "examples" / "serving"
WORKER = Path(__file__).parent / "serving_worker.py"
NUM_BLOCKS = 512
WORKER_CONFIGMAP = "kvshm-node-serving-worker"


def apply_namespace(node: Node) -> None:
    """examples/serving/namespace.yaml, once a namespace of that name an earlier test deleted
    is gone: one being deleted takes no new objects, and applying it again changes nothing."""
    [namespace] = load("namespace.yaml")
    name = namespace["metadata"]["name"]
    wait(
        lambda: node.kubectl(
            "get", "namespace", name, "--ignore-not-found", "-o", "jsonpath={.status.phase}"
        ) != "Terminating",
        180, f"namespace {name} of an earlier test gone", node,
    )  # fmt: skip
    apply_manifest(node, yaml.safe_dump(namespace))


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLE / name).read_text()) if d]


def region_manifest() -> dict[str, Any]:
    [region] = load("offloadregion.yaml")
    region = copy.deepcopy(region)
    region["spec"]["layout"]["numBlocks"] = NUM_BLOCKS
    return region


def region_layout(region: dict[str, Any]) -> RegionLayout:
    layout = region["spec"]["layout"]
    return RegionLayout(
        layout["numBlocks"], layout["cpuPageSize"], layout["numWorkers"],
        layout.get("format", "vllm-0.33"), replicated=layout.get("replicated", False),
    )  # fmt: skip


def worker_configmap(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": WORKER_CONFIGMAP, "namespace": namespace},
        "data": {"worker.py": WORKER.read_text()},
    }


def deployment(
    mode: str, image: str, regions: list[dict[str, Any]], example: str = "deployment.yaml"
) -> dict[str, Any]:
    """The example Deployment with its vLLM container replaced by the stand-in in `mode`, one
    per region (each engine of a data-parallel example), its health on the next port each."""
    [example_deployment] = load(example)
    manifest = copy.deepcopy(example_deployment)
    spec = manifest["spec"]["template"]["spec"]
    blocks = {r["spec"]["instanceId"]: r["spec"]["layout"]["numBlocks"] for r in regions}
    for init in spec["initContainers"]:
        init["image"] = image
        env = {variable["name"]: variable for variable in init["env"]}
        env["KVSHM_NUM_BLOCKS"]["value"] = str(blocks[env["KVSHM_INSTANCE_ID"]["value"]])
    [vllm] = spec["containers"]
    port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    commands = []
    for engine, region in enumerate(regions):
        layout = region_layout(region)
        job = {
            "instance_id": region["spec"]["instanceId"],
            "num_blocks": layout.num_blocks,
            "row_stride": layout.row_stride,
            "cpu_page_size": layout.cpu_page_size,
            "world": layout.num_workers,
            "replicated": layout.replicated,
            "port": port + engine,
        }
        commands.append(["python", "/node-test/worker.py", mode, json.dumps(job)])
    vllm["image"] = image
    if len(commands) == 1:
        vllm["command"] = commands[0]
    else:  # one stand-in per engine, each with its ranks' barrier directory
        vllm["command"] = ["sh", "-c", " & ".join(
            f"KVSHM_SYNC_DIR=/sync/{engine} {shlex.join(command)}"
            for engine, command in enumerate(commands)
        ) + " & wait"]  # fmt: skip
    vllm.pop("args", None)
    vllm["resources"] = {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "2Gi"},
    }
    vllm["volumeMounts"] += [
        {"name": "node-test", "mountPath": "/node-test", "readOnly": True},
        {"name": "sync", "mountPath": "/sync"},
    ]
    for volume in spec["volumes"]:
        if "persistentVolumeClaim" in volume:
            volume.pop("persistentVolumeClaim")
            volume["emptyDir"] = {}
    spec["volumes"] += [
        {"name": "node-test", "configMap": {"name": WORKER_CONFIGMAP}},
        {"name": "sync", "emptyDir": {}},
    ]
    return manifest


def pattern(rank: int, block: int) -> bytes:
    """What serving_worker.py writes at the start of rank `rank`'s cell of a block (with the
    replicated layout every rank writes cell 0's)."""
    return bytes((rank * 7 + block * 13 + i) % 256 for i in range(64))


def read_cell(
    directory: Path, instance_id: str, layout: RegionLayout, block: int, rank: int
) -> bytes:
    """The first 64 bytes of a rank's cell of a block, read from the region's files on the host."""
    offset = layout.cell_offset(block, rank)
    for region_file in layout.files(instance_id):
        if region_file.offset <= offset < region_file.offset + region_file.length:
            with open(directory / region_file.name, "rb") as handle:
                handle.seek(offset - region_file.offset)
                return handle.read(64)
    raise AssertionError(f"no file holds offset {offset}")
