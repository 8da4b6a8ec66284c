"""Who pays for a region, and what the kubelet does about it under memory pressure
(docs/deploy.md, "Memory: who pays for the regions" and "Priority and eviction").

Every populated region byte is charged to the agent's memory cgroup. Under node memory
pressure the kubelet ranks pods by usage above request, then priority: the agent comes first,
yet evicting it frees nothing (the tmpfs pages stay). With the chart's default priority class,
system-node-critical, the kubelet refuses to evict it and takes other pods instead. The node's
pressure is made by raising the kubelet's memory.available threshold above what is free."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.node.chart import CHART, Release, component, wait
from tests.node.memory import KUBEPODS, meminfo_bytes, memory_stat, pod_memory_cgroup
from tests.node.node import EVICTION_HARD, Node, NodeError
from tests.node.regions import apply_manifest, offload_region, region_phase, remove_regions

NAMESPACE = "pressure"
GIB = 2**30
REGION = offload_region(NAMESPACE, "charged", 4096)  # 1 GiB
REGION_FILE = Path("/dev/shm/kvshm") / NAMESPACE / "charged" / "vllm_offload_charged.mmap"


def _cgroup_bytes(pod: dict) -> dict[str, int]:
    cgroup = pod_memory_cgroup(pod["metadata"]["uid"])
    stat = memory_stat(cgroup)
    usage = int((cgroup / "memory.usage_in_bytes").read_text())
    return {"usage": usage, "shmem": stat["total_shmem"], "rss": stat["total_rss"]}


def _bystander(node: Node, image: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bystander", "namespace": NAMESPACE},
        "spec": {
            "containers": [{"name": "sleep", "image": image, "imagePullPolicy": "Never",
                            "command": ["sleep", "infinity"]}],
            "terminationGracePeriodSeconds": 1,
        },
    }  # fmt: skip
    apply_manifest(node, yaml.safe_dump(pod))
    wait(lambda: _phase(node, "bystander") == "Running", 120, "the bystander Running", node)


def _phase(node: Node, name: str) -> str | None:
    try:
        pod = json.loads(node.kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "json"))
    except NodeError:
        return None
    return str(pod["status"].get("phase"))


def _evicted(node: Node, namespace: str) -> list[str]:
    pods = json.loads(node.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    return [p["metadata"]["name"] for p in pods if (p["status"].get("reason") or "") == "Evicted"]


@contextlib.contextmanager
def memory_pressure(node: Node) -> Iterator[None]:
    """The kubelet told to keep more memory free than the machine has: it reports MemoryPressure
    and evicts; afterwards the thresholds are as before."""
    total_mib = meminfo_bytes("MemTotal") // 2**20
    try:
        node.configure_kubelet(
            evictionHard={**EVICTION_HARD, "memory.available": f"{total_mib - 512}Mi"},
            evictionPressureTransitionPeriod="5s",
        )
        yield
    finally:
        node.configure_kubelet(
            evictionHard=dict(EVICTION_HARD), evictionPressureTransitionPeriod=None
        )


def _agent(release: Release) -> dict:
    pods = [p for p in release.pods() if component(p) == "agent"]
    return max(pods, key=lambda p: p["metadata"]["creationTimestamp"])


@pytest.fixture
def charged(
    node: Node, kvshm_image: str, helm_home: Path, figures: dict[str, str]
) -> Iterator[Release]:
    """The chart with a 1 GiB region populated and locked, a BestEffort bystander beside it."""
    release = Release(node, helm_home)
    try:
        release.install()
        release.wait_ready()
        node.kubectl("create", "namespace", NAMESPACE)
        apply_manifest(node, yaml.safe_dump(REGION))
        wait(lambda: region_phase(node, NAMESPACE, "charged") == "Ready", 120, "Ready", node)
        agent = _agent(release)
        # the kernel folds per-CPU memory counters into memory.stat lazily (every 2 s at most)
        deadline = time.monotonic() + 30
        while (charge := _cgroup_bytes(agent))["shmem"] < GIB and time.monotonic() < deadline:
            time.sleep(0.5)
        figures["agent pod memory cgroup with 1 GiB of regions populated"] = (
            f"usage {charge['usage'] / GIB:.2f} GiB (shmem {charge['shmem'] / GIB:.2f} GiB, "
            f"rss {charge['rss'] / 2**20:.0f} MiB) against a request of 256 MiB"
        )
        assert charge["shmem"] >= GIB, (  # every region byte is the agent's
            f"the agent pod's cgroup holds {charge['shmem']} bytes of shmem, not the region's "
            f"{GIB}: {_charge_evidence(node, agent)}"
        )
        _bystander(node, kvshm_image)
    except BaseException:
        with contextlib.suppress(Exception):  # the set-up's own error is the one to report
            _remove(node, release)  # a failed set-up must not leave the release to the next test
        raise
    yield release
    _remove(node, release)


def _remove(node: Node, release: Release) -> None:
    remove_regions(node)
    release.uninstall()
    node.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--ignore-not-found", timeout=180)


def _charge_evidence(node: Node, agent: dict) -> str:
    """What says where the region's pages went: the agent's restarts, the root's mount, the
    file, and the shmem of every pod cgroup."""
    statuses = agent["status"].get("containerStatuses") or []
    restarts = {c["name"]: c.get("restartCount") for c in statuses}
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if "kvshm" in line]
    size = REGION_FILE.stat().st_size if REGION_FILE.exists() else None
    pods = {cgroup.name: memory_stat(cgroup)["total_shmem"] for cgroup in KUBEPODS.glob("**/pod*")}
    return (
        f"agent {agent['metadata']['name']} restarts {restarts}; mounts {mounts}; region file "
        f"{size} bytes; total_shmem by pod cgroup {pods}; {node.log('kubelet')[-1500:]}"
    )


def test_a_critical_agent_is_never_evicted_under_memory_pressure(
    node: Node, charged: Release, figures: dict[str, str]
) -> None:
    agent = _agent(charged)
    with memory_pressure(node):
        wait(lambda: "bystander" in _evicted(node, NAMESPACE), 180, "the bystander evicted", node)
        # the eviction manager ranks the agent first (most memory above its request) and refuses
        wait(
            lambda: "cannot evict a critical pod" in node.log("kubelet"),
            180, "the kubelet refusing to evict the agent", node,
        )  # fmt: skip
        evicted = _evicted(node, charged.namespace)
        assert _agent(charged)["metadata"]["uid"] == agent["metadata"]["uid"]
        assert _phase_of(_agent(charged)) == "Running" and agent["metadata"]["name"] not in evicted
    assert REGION_FILE.exists() and region_phase(node, NAMESPACE, "charged") == "Ready"
    figures["under memory pressure, agent at system-node-critical"] = (
        "kept (the kubelet: cannot evict a critical pod); evicted instead: the BestEffort "
        f"bystander and {', '.join(evicted) or 'no kvshm pod'}"
    )


def test_an_agent_of_no_priority_class_is_evicted_first_and_that_frees_nothing(
    node: Node, charged: Release, figures: dict[str, str]
) -> None:
    charged.helm("upgrade", charged.name, str(CHART), "-n", charged.namespace,
                 "--reuse-values", "--set", "agent.priorityClass.name=", "--wait")  # fmt: skip
    wait(lambda: not _agent(charged)["spec"].get("priorityClassName"), 120, "no class", node)
    charged.wait_ready()
    available = meminfo_bytes("MemAvailable")
    with memory_pressure(node):
        # its DaemonSet replaces each evicted agent, and the kubelet evicts the next one too
        evictions = wait(
            lambda: len(e := _eviction_events(node, charged.namespace, "kvshm-agent-")) >= 2 and e,
            180, "the agent evicted, twice", node,
        )  # fmt: skip
        # the region's pages stay: its file is there, and nothing came back to the node
        assert REGION_FILE.exists() and REGION_FILE.stat().st_blocks * 512 >= GIB
        assert meminfo_bytes("MemAvailable") < available + GIB // 2
        others = _eviction_events(node, charged.namespace, "kvshm-operator-")
    charged.wait_ready()
    wait(lambda: region_phase(node, NAMESPACE, "charged") == "Ready", 120, "Ready again", node)
    figures["under memory pressure, agent with no priority class"] = (
        f"evicted {len(evictions)} times (each replacement again), the operator "
        f"{len(others)} times; the 1 GiB region stayed on the tmpfs"
    )


def _eviction_events(node: Node, namespace: str, prefix: str) -> list[str]:
    events = json.loads(node.kubectl("get", "events", "-n", namespace, "-o", "json"))["items"]
    return [
        e["involvedObject"]["name"]
        for e in events
        if e["reason"] == "Evicted" and e["involvedObject"]["name"].startswith(prefix)
    ]


def _phase_of(pod: dict) -> str:
    return str(pod["status"].get("phase"))
