"""Faults on the real node: the agent's pod deleted (its DaemonSet's next pod adopts every
region, no byte or file lost), the operator's pod deleted in the middle of a deletion, and the
kubelet restarted under running regions."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agent.builders import holding
from tests.node.chart import Release, component, wait
from tests.node.node import Node
from tests.node.regions import (
    TENANT_ACCESS,
    apply_manifest,
    node_report,
    offload_region,
    region,
    region_phase,
    remove_regions,
)

NAMESPACE = "faults"
ROOT = Path("/dev/shm/kvshm")


def _region(name: str, blocks: int = 1024) -> dict[str, Any]:
    return offload_region(NAMESPACE, name, blocks, access=TENANT_ACCESS)


def _file(name: str) -> Path:
    return ROOT / NAMESPACE / name / f"vllm_offload_{name}.mmap"


def _write_pattern(path: Path) -> str:
    """A tenant's bytes over the whole file; their digest."""
    digest = hashlib.sha256()
    with open(path, "r+b") as handle:
        for chunk in range(path.stat().st_size // 2**20):
            data = hashlib.sha256(f"{path.name}:{chunk}".encode()).digest() * (2**20 // 32)
            handle.write(data)
            digest.update(data)
    return digest.hexdigest()


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def _agent_pod(release: Release) -> dict[str, object]:
    [pod] = [p for p in release.pods() if component(p) == "agent"]
    return pod


@pytest.fixture(scope="module")
def installed(
    node: Node, kvshm_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    release = Release(node, tmp_path_factory.mktemp("helm"))
    release.install("--set", "agent.resyncSeconds=5", "--set", "agent.drainGraceSeconds=300")
    release.wait_ready()
    node.kubectl("create", "namespace", NAMESPACE)
    yield release
    remove_regions(node)
    release.uninstall()
    node.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def test_a_deleted_agent_pods_successor_adopts_every_region_byte_for_byte(
    node: Node, installed: Release, figures: dict[str, str]
) -> None:
    names = ["adopt-a", "adopt-b", "adopt-c"]
    for name in names:
        apply_manifest(node, yaml.safe_dump(_region(name)))
    for name in names:
        wait(lambda n=name: region_phase(node, NAMESPACE, n) == "Ready", 120, f"{name}", node)
    before = {}
    for name in names:
        path = _file(name)
        before[name] = (os.lstat(path).st_ino, _write_pattern(path))
    old = _agent_pod(installed)
    started = time.monotonic()
    node.kubectl("delete", "pod", "-n", installed.namespace, old["metadata"]["name"])  # type: ignore[index]
    [new] = installed.wait_ready(("agent",))
    assert new["metadata"]["uid"] != old["metadata"]["uid"]  # type: ignore[index]
    for name in names:
        # the new process reports the region again, with its mlock restored
        wait(
            lambda n=name: (r := node_report(node, NAMESPACE, n)).get("phase") == "Ready"
            and r.get("locked") is True,
            120, f"{name} Ready under the new agent", node,
        )  # fmt: skip
    figures["agent pod deleted to its successor Ready, 3 regions adopted"] = (
        f"{time.monotonic() - started:.1f} s"
    )
    for name in names:
        path = _file(name)
        assert (os.lstat(path).st_ino, _digest(path)) == before[name], name
        assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("vllm_")) == [
            path.name
        ]
    events = node.kubectl("get", "events", "-n", NAMESPACE, "-o", "jsonpath={.items[*].reason}")
    assert "Created" in events and events.split().count("Created") == len(names)
    remove_regions(node)


def test_the_operators_pod_deleted_in_the_middle_of_a_deletion(
    node: Node, installed: Release
) -> None:
    """A held region is deleted; while its agent drains, the operator's pod is deleted. The
    next operator finishes: once the holder lets go, the files go and the finalizer with them."""
    name = "held"
    apply_manifest(node, yaml.safe_dump(_region(name, blocks=256)))
    wait(lambda: region_phase(node, NAMESPACE, name) == "Ready", 120, "Ready", node)
    path = _file(name)
    with holding(path, "flock") as holder:
        wait(lambda: node_report(node, NAMESPACE, name).get("holders") == 1, 60, "held", node)
        node.kubectl("delete", "offloadregion", name, "-n", NAMESPACE, "--wait=false")
        wait(
            lambda: node_report(node, NAMESPACE, name).get("phase") == "Draining",
            60, "draining", node,
        )  # fmt: skip
        [operator] = [p for p in installed.pods() if component(p) == "operator"]
        node.kubectl("delete", "pod", "-n", installed.namespace, operator["metadata"]["name"])
        installed.wait_ready(("operator",))
        time.sleep(3)
        assert region(node, NAMESPACE, name) is not None  # held: nothing is released yet
        assert path.exists()
        holder.kill()
    wait(lambda: region(node, NAMESPACE, name) is None, 90, "the region released", node)
    assert not path.exists() and not path.parent.exists()


def test_a_restarted_kubelet_leaves_pods_and_regions_as_they_were(
    node: Node, installed: Release
) -> None:
    name = "kubelet-restart"
    apply_manifest(node, yaml.safe_dump(_region(name, blocks=256)))
    wait(lambda: region_phase(node, NAMESPACE, name) == "Ready", 120, "Ready", node)
    path = _file(name)
    digest = _write_pattern(path)
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in installed.pods()}
    node.restart_kubelet()
    ready = installed.wait_ready()
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in ready} == {
        n: u for n, u in pods.items() if n in {p["metadata"]["name"] for p in ready}
    }
    assert all(c["restartCount"] == 0 for p in ready for c in p["status"]["containerStatuses"]), [
        p["status"]["containerStatuses"] for p in ready
    ]
    installed.helm("test", installed.name, "-n", installed.namespace, timeout=180)
    assert _digest(path) == digest and region_phase(node, NAMESPACE, name) == "Ready"
    remove_regions(node)
