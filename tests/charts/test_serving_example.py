"""examples/serving: a valid Deployment wired to its OffloadRegion the way the chart expects
(region directory at /dev/shm, same node placement, uid/gid and instance id)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from tests.charts.rendering import load_yaml_documents
from tests.charts.tools import CHART, REPO

EXAMPLE = REPO / "examples" / "serving"


def _objects() -> tuple[dict[str, Any], dict[str, Any]]:
    [region] = load_yaml_documents(EXAMPLE / "offloadregion.yaml")
    [deployment] = load_yaml_documents(EXAMPLE / "deployment.yaml")
    return region, deployment


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_deployment_is_valid_kubernetes() -> None:
    _, deployment = _objects()
    kubernetes_validate.validate(deployment, "1.32.0", strict=True)


def test_region_directory_is_mounted_at_dev_shm() -> None:
    region, deployment = _objects()
    spec = deployment["spec"]["template"]["spec"]
    root = yaml.safe_load((CHART / "values.yaml").read_text())["regionRoot"]
    meta = region["metadata"]
    [volume] = [v for v in spec["volumes"] if "hostPath" in v]
    assert volume["hostPath"] == {
        "path": f"{root}/{meta['namespace']}/{meta['name']}",
        "type": "Directory",
    }
    for container in [*spec["initContainers"], *spec["containers"]]:
        [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == "/dev/shm", container["name"]


def test_pod_matches_the_region_placement_owner_and_id() -> None:
    region, deployment = _objects()
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["metadata"]["namespace"] == region["metadata"]["namespace"]
    assert spec["nodeSelector"] == region["spec"]["placement"]["nodeSelector"]
    access = region["spec"]["access"]
    assert spec["securityContext"]["runAsUser"] == access["uid"]
    assert spec["securityContext"]["runAsGroup"] == access["gid"]
    layout = region["spec"]["layout"]
    size = layout["numBlocks"] * layout["cpuPageSize"] * layout["numWorkers"]
    [wait] = spec["initContainers"]
    assert _env(wait) == {
        "KVSHM_INSTANCE_ID": region["spec"]["instanceId"],
        "KVSHM_REGION_BYTES": str(size),
    }
    [engine] = spec["containers"]
    assert _env(engine)["KVSHM_INSTANCE_ID"] == region["spec"]["instanceId"]
    assert f"--tensor-parallel-size={layout['numWorkers']}" in engine["args"]


def test_serving_pods_are_found_by_the_charts_pod_monitor() -> None:
    _, deployment = _objects()
    monitor = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    selector = monitor["servingPodMonitor"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert monitor["servingPodMonitor"]["port"] in {p["name"] for p in ports}
