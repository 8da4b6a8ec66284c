"""`helm install` on a real node, as docs/deploy.md says it: with the default values and with
the production values (its GPU node selector satisfied by labelling the node). Every pod
Running and Ready, no probe failing, `helm test` passing, and a region Ready through the
hostPath on the node's tmpfs."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from tests.node.chart import CHART, Release, component, pod_ready, restarts, wait
from tests.node.node import NODE_NAME, Node
from tests.node.regions import apply_manifest, region_phase, remove_regions

DEMO = Path(__file__).resolve().parents[2] / "examples" / "regions" / "demo.yaml"
GPU_LABEL = "nvidia.com/gpu.present"


def _unhealthy_events(node: Node, namespace: str, pods: list[dict[str, Any]]) -> list[str]:
    """Probe failures and back-offs of these pods, but for readiness failures before a pod first
    turned Ready (the kubelet probes at once, while the process still starts: the port is not
    open yet, or /readyz says 503 until the first reconcile pass)."""
    ready_since = {
        p["metadata"]["uid"]: next(
            c["lastTransitionTime"] for c in p["status"]["conditions"] if c["type"] == "Ready"
        )
        for p in pods
    }
    events = json.loads(node.kubectl("get", "events", "-n", namespace, "-o", "json"))["items"]
    return [
        f"{e['involvedObject']['name']}: {e['message']}"
        for e in events
        if e.get("reason") in ("Unhealthy", "BackOff", "Failed")
        and e["involvedObject"].get("uid") in ready_since
        and not (
            e["message"].startswith("Readiness probe failed")
            and (e.get("lastTimestamp") or e["eventTime"])
            <= ready_since[e["involvedObject"]["uid"]]
        )
    ]


def _install_and_check(
    node: Node, release: Release, figures: dict[str, str], label: str, *values: str
) -> None:
    started = time.monotonic()
    release.install(*values)
    pods = release.wait_ready()
    figures[f"helm install to every pod Ready ({label})"] = f"{time.monotonic() - started:.1f} s"
    assert {p["spec"]["nodeName"] for p in pods} == {NODE_NAME}
    release.helm("test", release.name, "-n", release.namespace, "--logs", timeout=180)

    region_started = time.monotonic()
    apply_manifest(node, DEMO.read_text())
    wait(lambda: region_phase(node, "default", "demo") == "Ready", 120, "demo Ready", node)
    figures[f"OffloadRegion applied to Ready, 1 GiB ({label})"] = (
        f"{time.monotonic() - region_started:.1f} s"
    )
    path = Path("/dev/shm/kvshm/default/demo/vllm_offload_demo-engine.mmap")
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode) and info.st_size == 2**30
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 0, 0o600)
    assert info.st_blocks * 512 >= 2**30  # populated on the node's tmpfs

    # the probes kept passing: nothing restarted, no probe failed once Ready
    components = [p for p in release.pods() if component(p) in ("agent", "operator")]
    for pod in components:
        assert pod_ready(pod) and restarts(pod) == 0, pod["status"]
    assert _unhealthy_events(node, release.namespace, components) == []
    remove_regions(node)


def test_default_values(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> None:
    release = Release(node, helm_home)
    try:
        _install_and_check(node, release, figures, "default values")
    finally:
        remove_regions(node)
        release.uninstall()


def test_production_values_on_a_gpu_labelled_node(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> None:
    """values-production.yaml: agents only on GPU nodes (the label, and its taint tolerated),
    hostPID with the /proc scan; nothing else needs to exist first."""
    release = Release(node, helm_home)
    node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}-", "--overwrite")
    try:
        release.install("-f", str(CHART / "values-production.yaml"))
        # not a GPU node yet: no agent is scheduled, the operator runs
        release.wait_ready(("operator",))
        assert [p for p in release.pods() if "agent" in p["metadata"]["name"]] == []
        release.uninstall()
        node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}=true")
        _install_and_check(
            node, release, figures, "production values", "-f", str(CHART / "values-production.yaml")
        )
        dashboards = node.kubectl("get", "configmaps", "-n", release.namespace, "-o", "name")
        assert "dashboard" in dashboards
    finally:
        remove_regions(node)
        release.uninstall()
        node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}-")
