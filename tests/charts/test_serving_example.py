"""examples/serving: valid Deployments wired to their OffloadRegions the way the chart expects
(region files at /dev/shm, same placement, uid/gid), regions that are exactly what the
`kvshm layout` command in their comments prints, vLLM flags that are exactly its --flags-only
output, and an init container that waits for every file of every region."""

from __future__ import annotations

import shlex
from itertools import takewhile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvshm.api import parse_offload_region
from kvshm.cli import main
from kvshm.region import RegionLayout
from tests.charts.rendering import load_yaml_documents
from tests.charts.tools import CHART, REPO

EXAMPLE = REPO / "examples" / "serving"
# (regions file, deployment file)
DATA_PARALLEL = EXAMPLE / "data-parallel"
QUICKSTART = EXAMPLE / "quickstart"
EXAMPLES = [
    (EXAMPLE / "offloadregion.yaml", EXAMPLE / "deployment.yaml"),
    (QUICKSTART / "offloadregion.yaml", QUICKSTART / "deployment.yaml"),
    (DATA_PARALLEL / "offloadregions.yaml", DATA_PARALLEL / "deployment.yaml"),
]
IDS = ["single", "quickstart", "data-parallel"]


def _objects(example: tuple[Path, Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    regions = load_yaml_documents(example[0])
    [deployment] = load_yaml_documents(example[1])
    return regions, deployment


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _layout(region: dict[str, Any]) -> RegionLayout:
    """The region's layout as the agent reads it from the manifest."""
    return parse_offload_region(region).layout


def _layout_command(path: Path) -> list[str]:
    """The `kvshm layout` arguments a regions file's header comment says made it."""
    lines = path.read_text().splitlines()
    header = [line[1:].strip() for line in takewhile(lambda line: line.startswith("#"), lines)]
    start = next(i for i, line in enumerate(header) if line.startswith("kvshm layout"))
    parts = []
    for line in header[start:]:
        parts.append(line.removesuffix("\\"))
        if not line.endswith("\\"):
            break
    command = shlex.split(" ".join(parts))
    command[2] = str(REPO / command[2])  # the model's config.json, relative to the repository
    return command[2:]


def _run_layout(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(["layout", *args]) == 0
    out, _ = capsys.readouterr()
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_deployment_is_valid_kubernetes(example: tuple[Path, Path]) -> None:
    _, deployment = _objects(example)
    kubernetes_validate.validate(deployment, "1.32.0", strict=True)
    [configmap] = load_yaml_documents(EXAMPLE / "wait-for-region.yaml")
    kubernetes_validate.validate(configmap, "1.32.0", strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_regions_are_what_kvshm_layout_prints(
    example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _layout_command(example[0])
    regions, _ = _objects(example)
    assert list(yaml.safe_load_all(_run_layout(capsys, args))) == regions


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_engine_gets_exactly_the_flags_kvshm_layout_prints(
    example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _layout_command(example[0])
    flags = _run_layout(capsys, [*args, "--flags-only"]).splitlines()
    _, deployment = _objects(example)
    [engine] = deployment["spec"]["template"]["spec"]["containers"]
    assert engine["command"] == ["vllm", "serve"]
    assert engine["args"][2:] == flags  # after the model and --port


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_every_region_file_is_at_dev_shm_and_waited_for(example: tuple[Path, Path]) -> None:
    regions, deployment = _objects(example)
    spec = deployment["spec"]["template"]["spec"]
    root = yaml.safe_load((CHART / "values.yaml").read_text())["regionRoot"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    [engine] = spec["containers"]
    engine_mounts = {m["mountPath"]: volumes[m["name"]] for m in engine["volumeMounts"]}
    waits = {_env(c)["KVSHM_INSTANCE_ID"]: c for c in spec["initContainers"]}
    assert set(waits) == {r["spec"]["instanceId"] for r in regions}
    directories = []
    for region in regions:
        name = region["metadata"]["name"]
        directory = f"{root}/{region['metadata']['namespace']}/{name}"
        directories.append(directory)
        # a whole directory mounted at /dev/shm may be made by the kubelet before the region
        # (the init container then waits); a directory mounted below the pod's own /dev/shm
        # must be there
        kind = "DirectoryOrCreate" if len(regions) == 1 else "Directory"
        whole_dir = {"path": directory, "type": kind}
        wait = waits[region["spec"]["instanceId"]]
        wait_mounts = {m["mountPath"]: volumes[m["name"]] for m in wait["volumeMounts"]}
        layout = region["spec"]["layout"]
        linking: dict[str, str] = {}
        if len(regions) == 1:  # the region's directory is the engine's /dev/shm
            assert engine_mounts["/dev/shm"]["hostPath"] == whole_dir
            assert wait_mounts["/dev/shm"]["hostPath"] == whole_dir
        else:  # each region at a directory of its own, its files linked into the pod's /dev/shm
            mounted_at = f"/dev/shm/kvshm/{name}"
            assert engine_mounts[mounted_at]["hostPath"] == whole_dir
            assert wait_mounts[mounted_at]["hostPath"] == whole_dir  # where the links point
            assert engine_mounts["/dev/shm"] == wait_mounts["/dev/shm"]
            assert engine_mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
            linking = {"KVSHM_DIR": mounted_at, "KVSHM_LINK_DIR": "/dev/shm"}
        assert _env(wait) == {
            "KVSHM_INSTANCE_ID": region["spec"]["instanceId"],
            "KVSHM_NUM_BLOCKS": str(layout["numBlocks"]),
            "KVSHM_ROW_STRIDE": str(_layout(region).row_stride),
            "KVSHM_FORMAT": layout["format"],
            **linking,
        }
        assert wait["command"] == ["sh", "/kvshm/wait-for-region.sh"]
    # no hostPath but the regions' directories (a path inside one may be its tenant's symlink)
    host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert sorted(host_paths) == sorted(directories)


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_pod_matches_the_region_placement_and_owner(example: tuple[Path, Path]) -> None:
    regions, deployment = _objects(example)
    spec = deployment["spec"]["template"]["spec"]
    for region in regions:
        assert deployment["metadata"]["namespace"] == region["metadata"]["namespace"]
        assert spec["nodeSelector"] == region["spec"]["placement"]["nodeSelector"]
        access = region["spec"]["access"]
        assert spec["securityContext"]["runAsUser"] == access["uid"]
        assert spec["securityContext"]["runAsGroup"] == access["gid"]


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_serving_pods_are_found_by_the_charts_pod_monitor(example: tuple[Path, Path]) -> None:
    _, deployment = _objects(example)
    monitor = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    selector = monitor["servingPodMonitor"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert monitor["servingPodMonitor"]["port"] in {p["name"] for p in ports}


SERVING_DEPLOYMENTS = sorted(
    (path, doc)
    for path in EXAMPLE.rglob("*.yaml")
    for doc in load_yaml_documents(path)
    if doc["kind"] == "Deployment"
)


def test_every_serving_example_is_found() -> None:
    found = {path.relative_to(EXAMPLE).as_posix() for path, _ in SERVING_DEPLOYMENTS}
    assert found >= {
        "deployment.yaml",
        "quickstart/deployment.yaml",
        "plugin/deployment.yaml",
        "data-parallel/deployment.yaml",
    }


@pytest.mark.parametrize(
    "deployment",
    [doc for _, doc in SERVING_DEPLOYMENTS],
    ids=[path.relative_to(EXAMPLE).as_posix() for path, _ in SERVING_DEPLOYMENTS],
)
def test_a_region_serves_one_engine_per_node_even_during_a_rollout(
    deployment: dict[str, Any],
) -> None:
    """Two engines on one node share its one copy of the region and overwrite each other's
    blocks: replicas never share a node, and a rollout stops the old pod before the new one."""
    template = deployment["spec"]["template"]
    terms = template["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(
        term["topologyKey"] == "kubernetes.io/hostname"
        and term["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        and "namespaces" not in term
        and "namespaceSelector" not in term
        for term in terms
    ), terms
    strategy = deployment["spec"].get("strategy", {})
    rolling = strategy.get("rollingUpdate", {})
    assert strategy.get("type") == "Recreate" or (
        strategy.get("type") == "RollingUpdate" and rolling.get("maxSurge") == 0
    ), strategy
