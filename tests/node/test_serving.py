"""A serving pod built from examples/serving on the real node (tests/node/serving.py says what
is kept and what is replaced), attaching the agent's region as vLLM 0.33's own code does and
as kvshm's plugin does. The pod starts only once its init container has seen the region; its
ranks write and read the region, which the host sees in the region's files; it is counted as
a holder; the second replica is kept off the node by the anti-affinity; and when its region is
deleted, the plugin's ranks get the drain event and let go before the grace period ends. The
data-parallel example's pod attaches both engines' regions through the links its init
containers make in its own /dev/shm, each region's directory its only hostPath there."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.node.chart import CHART, Release, describe_cluster, wait
from tests.node.node import NODE_NAME, Node, NodeError
from tests.node.regions import apply_manifest, node_report, region, region_phase, remove_regions
from tests.node.serving import (
    EXAMPLE,
    apply_namespace,
    deployment,
    load,
    pattern,
    read_cell,
    region_layout,
    region_manifest,
    worker_configmap,
)

NAMESPACE = "serving"
GPU_LABEL = "nvidia.com/gpu.present"


@pytest.fixture(scope="module")
def production(
    node: Node, kvshm_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """The chart with the production values on a GPU-labelled node, and the example's namespace
    and init container script applied as the example says."""
    release = Release(node, tmp_path_factory.mktemp("helm"))
    node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}=true", "--overwrite")
    release.install("-f", str(CHART / "values-production.yaml"))
    release.wait_ready()
    apply_namespace(node)
    apply_manifest(node, (EXAMPLE / "wait-for-region.yaml").read_text())
    yield release
    remove_regions(node)
    release.uninstall()
    node.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
    node.kubectl("label", "node", NODE_NAME, f"{GPU_LABEL}-")


def _pods(node: Node, app: str = "llama-70b") -> list[dict]:
    listed = json.loads(
        node.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"app={app}", "-o", "json")
    )
    return listed["items"]


def _logs(node: Node, pod: str, container: str) -> list[dict]:
    """The stand-in's events, from its current container and the one before (the plugin's ranks
    exit after their drain, and the kubelet starts the container again)."""
    lines = node.kubectl("logs", "-n", NAMESPACE, pod, "-c", container).splitlines()
    with contextlib.suppress(NodeError):  # no earlier container
        lines += node.kubectl(
            "logs", "-n", NAMESPACE, pod, "-c", container, "--previous"
        ).splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


@contextlib.contextmanager
def _deployed(node: Node, app: str, regions_timeout: float = 120) -> Iterator[None]:
    """Say what the cluster shows when an assertion fails; delete the Deployment and every
    region after."""
    try:
        yield
    except AssertionError:
        print(describe_cluster(node))
        raise
    finally:
        node.kubectl("delete", "deployment", app, "-n", NAMESPACE, "--wait=true", timeout=180)
        remove_regions(node, timeout=regions_timeout)


def _running_pod(node: Node, app: str = "llama-70b") -> dict | None:
    for pod in _pods(node, app):
        if pod["status"].get("phase") == "Running" and pod["spec"].get("nodeName") == NODE_NAME:
            return pod
    return None


@pytest.mark.parametrize("mode", ["vllm", "plugin"])
def test_a_serving_pod_attaches_writes_holds_and_lets_go(
    node: Node, production: Release, serving_image: str, mode: str, figures: dict[str, str]
) -> None:
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(worker_configmap(NAMESPACE)))
    manifest = region_manifest()
    name, instance_id = manifest["metadata"]["name"], manifest["spec"]["instanceId"]
    layout = region_layout(manifest)
    directory = Path("/dev/shm/kvshm") / NAMESPACE / name
    app = deployment(mode, serving_image, [manifest])
    with _deployed(node, "llama-70b"):
        # the pod before its region: it waits in its init container, vLLM's does not start
        apply_manifest(node, yaml.safe_dump(app))
        waiting = wait(
            lambda: next(
                (p for p in _pods(node) if (p["status"].get("initContainerStatuses") or [{}])[0]
                 .get("state", {}).get("running")), None,
            ),
            120, "a serving pod in its init container", node,
        )  # fmt: skip
        time.sleep(5)
        pod = next(p for p in _pods(node) if p["metadata"]["name"] == waiting["metadata"]["name"])
        assert pod["status"]["phase"] == "Pending", pod["status"]
        assert not any(
            c["state"].get("running") for c in pod["status"].get("containerStatuses") or []
        )
        init_log = node.kubectl(
            "logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "wait-for-region"
        )
        assert f"waiting for region {instance_id}: " in init_log and "is missing" in init_log

        started = time.monotonic()
        apply_manifest(node, yaml.safe_dump(manifest))
        wait(lambda: region_phase(node, NAMESPACE, name) == "Ready", 180, "the region Ready", node)
        running = wait(lambda: _running_pod(node), 180, "the serving pod Running", node)
        pod_name = running["metadata"]["name"]
        wait(
            lambda: len([e for e in _logs(node, pod_name, "vllm") if e["event"] == "verified"])
            == layout.num_workers,
            180, "every rank verified", node,
        )  # fmt: skip
        figures[f"region applied to serving pod attached, 2.5 GiB ({mode})"] = (
            f"{time.monotonic() - started:.1f} s"
        )
        events = _logs(node, pod_name, "vllm")
        verified = [e for e in events if e["event"] == "verified"]
        assert sorted(e["rank"] for e in verified) == list(range(layout.num_workers)), events
        assert all(e["wrong"] == [] and e["mode"] == mode for e in verified), events
        assert "ready: 2 file(s)" in node.kubectl(
            "logs", "-n", NAMESPACE, pod_name, "-c", "wait-for-region"
        )

        # what the pod wrote is in the agent's files on the node's tmpfs
        for block in (0, 1, layout.num_blocks // 2, layout.num_blocks - 1):
            for rank in range(layout.num_workers):
                assert read_cell(directory, instance_id, layout, block, rank) == pattern(
                    rank, block
                )

        # one engine per node: the second replica is not scheduled here
        pending = [p for p in _pods(node) if p["metadata"]["name"] != pod_name]
        assert len(pending) == 1 and pending[0]["status"]["phase"] == "Pending"
        scheduled = {c["type"]: c for c in pending[0]["status"]["conditions"]}["PodScheduled"]
        assert "anti-affinity" in scheduled["message"], scheduled

        report = wait(
            lambda: (r := node_report(node, NAMESPACE, name)).get("holders") is not None and r,
            60, "the agent's report", node,
        )  # fmt: skip
        if mode == "plugin":
            # every rank holds its shared flock: the agent counts them through the host's table
            wait(
                lambda: node_report(node, NAMESPACE, name).get("holders") == layout.num_workers,
                60, f"holders == {layout.num_workers}", node,
            )  # fmt: skip
        else:
            # vLLM's own code takes no lock; with hostPID the agent's /proc scan sees it
            assert report["holders"] == 0, report

        deleted = time.monotonic()
        node.kubectl("delete", "offloadregion", name, "-n", NAMESPACE, "--wait=false")
        if mode == "plugin":
            wait(
                lambda: len([e for e in _logs(node, pod_name, "vllm") if e["event"] == "drained"])
                == layout.num_workers,
                60, "every rank drained", node,
            )  # fmt: skip
            wait(lambda: region(node, NAMESPACE, name) is None, 60, "the region gone", node)
            gone_after = time.monotonic() - deleted
            assert gone_after < 30, f"released after {gone_after:.1f} s: the grace period decided"
            figures["region deleted to gone, plugin pod drained"] = f"{gone_after:.1f} s"
        else:
            # held by a lock-less mapping: the agent drains, waiting for it
            wait(
                lambda: node_report(node, NAMESPACE, name).get("phase") == "Draining",
                30, "the agent draining", node,
            )  # fmt: skip
            time.sleep(5)
            assert region_phase(node, NAMESPACE, name) == "Terminating"
            assert node_report(node, NAMESPACE, name)["phase"] == "Draining"
            assert (directory / f"vllm_offload_{instance_id}.mmap").exists()
        assert not any(directory.glob("vllm_offload_*")) or mode == "vllm"


def test_the_data_parallel_example_attaches_each_engine_through_links(
    node: Node, production: Release, serving_image: str, figures: dict[str, str]
) -> None:
    """examples/serving/data-parallel as shipped (two 4 GiB regions of three files each, MLA's
    replicated layout at TP 2): each init container waits for its region and links its files
    into the pod's /dev/shm (an emptyDir, the region's directory mounted below it), and vLLM
    0.33's own code in every rank of both engines opens them through the links as a joiner."""
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(worker_configmap(NAMESPACE)))
    regions = load("data-parallel/offloadregions.yaml")
    app = deployment("vllm", serving_image, regions, "data-parallel/deployment.yaml")
    engines = {r["spec"]["instanceId"]: region_layout(r) for r in regions}
    directories = {
        r["spec"]["instanceId"]: Path("/dev/shm/kvshm") / NAMESPACE / r["metadata"]["name"]
        for r in regions
    }
    with _deployed(node, "dsv2-lite", regions_timeout=300):
        for manifest in regions:
            apply_manifest(node, yaml.safe_dump(manifest))
        for manifest in regions:
            name = manifest["metadata"]["name"]
            wait(lambda n=name: region_phase(node, NAMESPACE, n) == "Ready", 300, name, node)
        # the regions first: the kubelet starts no pod while a Directory hostPath is missing
        started = time.monotonic()
        apply_manifest(node, yaml.safe_dump(app))
        running = wait(lambda: _running_pod(node, "dsv2-lite"), 300, "the pod Running", node)
        pod_name = running["metadata"]["name"]
        expected = {
            (e, rank) for e, layout in engines.items() for rank in range(layout.num_workers)
        }
        wait(
            lambda: {(e["instance"], e["rank"]) for e in _logs(node, pod_name, "vllm")
                     if e["event"] == "verified"} == expected,
            300, "every rank of both engines verified", node,
        )  # fmt: skip
        figures["data-parallel example: pod applied to both engines attached (2 x 4 GiB)"] = (
            f"{time.monotonic() - started:.1f} s"
        )
        verified = [e for e in _logs(node, pod_name, "vllm") if e["event"] == "verified"]
        assert all(e["wrong"] == [] for e in verified), verified
        for index, (engine, layout) in enumerate(engines.items()):
            init = node.kubectl(
                "logs", "-n", NAMESPACE, pod_name, "-c", f"wait-for-region-dp{index}"
            )
            assert f"region {engine} ready: 3 file(s)" in init, init
            assert "linked 3 file(s) into /dev/shm" in init, init
            # what the ranks wrote (cell 0: replicated) is in the agent's files on the host,
            # which are still regular files, and no link or other vLLM file is beside them
            for block in (0, layout.num_blocks // 2, layout.num_blocks - 1):
                assert read_cell(directories[engine], engine, layout, block, 0) == pattern(0, block)
            names = sorted(os.listdir(directories[engine]))
            assert [f.name for f in layout.files(engine)] == [
                n for n in names if n.startswith("vllm")
            ]
            for name in names:
                assert stat.S_ISREG(os.lstat(directories[engine] / name).st_mode), name
