"""The agent and the operator as processes against a real kube-apiserver, each with the token
of the chart's own ServiceAccount (so a permission the chart lacks fails here), beside two
fake Nodes whose agents keep real files on a real tmpfs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from kvshm.api import GROUP, REGION_PLURAL, VERSION
from kvshm.operator.kopf_settings import FINALIZER
from tests.envtest.server import EnvTest
from tests.operator.harness import TEST_CONFIG, Agent, Cluster, Holder, OperatorProcess
from tests.waiting import wait_for

CRD = Path(__file__).resolve().parents[2] / "charts/kvshm/crds/offloadregions.kvshm.dev.yaml"


def region_file(cluster: Cluster, name: str) -> str:
    return f"{cluster.namespace}/{name}/vllm_offload_{name}.mmap"


def test_operator_starts_and_gets_a_region_ready(
    api_cluster: Cluster, api_agents: dict[str, Agent], api_operator: OperatorProcess
) -> None:
    api_cluster.create_region("r1")
    status = api_cluster.wait_phase("r1", "Ready", timeout=60)
    assert (status["nodesReady"], status["nodesWanted"]) == (2, 2)
    assert status["observedGeneration"] == 1
    assert api_operator.process is not None and api_operator.process.poll() is None
    assert "BadRequest" not in api_operator.output()  # kopf's watches were refused with 400
    # each line about a region names it; the book logs it once its write's answer is back, which
    # can be after the Ready status reached this test's watch
    line = f"[{api_cluster.namespace}/r1] status Ready: ready on 2/2 nodes"
    wait_for(lambda: line in api_operator.output(), 10, f"the operator to log {line!r}")
    for agent in api_agents.values():
        assert agent.files() == [region_file(api_cluster, "r1")]
    api_cluster.delete_region("r1")
    api_cluster.wait_gone("r1", timeout=30)
    for agent in api_agents.values():
        assert agent.files() == []


# A Node name is a DNS subdomain of up to 253 characters; fully qualified names are common.
LONGEST_NODE = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])


def test_a_node_name_of_253_characters_works_everywhere(
    api_cluster: Cluster,
    api_operator: OperatorProcess,
    small_tmpfs: Path,
    tmp_path: Path,
) -> None:
    assert len(LONGEST_NODE) == 253
    api_cluster.add_node(LONGEST_NODE)
    agent = Agent(LONGEST_NODE, small_tmpfs / "long", api_cluster.kubeconfig, tmp_path).start()
    try:
        wait_for(
            lambda: ((api_cluster.offload_node(LONGEST_NODE) or {}).get("status") or {}).get(
                "heartbeat"
            ),
            30,
            f"the agent to report (log: {agent.output()[-3000:]})",
        )
        api_cluster.create_region("r1", placement={"nodeNames": [LONGEST_NODE]})
        status = api_cluster.wait_phase("r1", "Ready", timeout=60)
        assert status["nodes"][LONGEST_NODE]["phase"] == "Ready"
        assert agent.files() == [region_file(api_cluster, "r1")]
        api_cluster.wait_events("r1", "Created", "Ready")
    finally:
        agent.stop()
    assert "failed" not in agent.output().lower(), agent.output()[-3000:]


def dns_name(index: int, length: int) -> str:
    """A distinct node name of `length` characters (a DNS subdomain of 63-character labels)."""
    text = f"n{index:05d}" + "x" * (length - 6)
    return ".".join(text[i : i + 62] for i in range(0, len(text), 62))[:length].rstrip(".")


def test_a_placement_naming_30_long_unknown_nodes_fails_with_a_summary(
    api_cluster: Cluster, api_operator: OperatorProcess
) -> None:
    unknown = sorted(dns_name(i, 200) for i in range(30))
    api_cluster.create_region("r1", placement={"nodeNames": unknown})
    status = api_cluster.wait_phase("r1", "Failed", timeout=60)
    message = status["message"]
    assert len(message) <= 4096
    assert "30 nodes" in message and unknown[0] in message and "27 more" in message, message
    assert api_cluster.condition("r1", "Accepted")["reason"] == "UnknownNode"
    api_cluster.delete_region("r1")
    api_cluster.wait_gone("r1", timeout=30)


def largest_spec() -> dict[str, Any]:
    """The largest spec the CRD admits: as many of the longest node names and selector labels
    as it allows (and the longest instance id)."""
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    names = spec["properties"]["placement"]["properties"]["nodeNames"]
    selector = spec["properties"]["placement"]["properties"]["nodeSelector"]
    name_length = names["items"]["maxLength"]
    value_length = selector["additionalProperties"]["maxLength"]
    return {
        "instanceId": "i" * 128,
        "placement": {
            "nodeNames": [dns_name(i, name_length) for i in range(names["maxItems"])],
            "nodeSelector": {
                f"{dns_name(i, 253)}/{'k' * 63}": "v" * value_length
                for i in range(selector["maxProperties"])
            },
        },
    }


def test_the_largest_spec_gets_a_phase_and_deletes(
    api_cluster: Cluster, api_operator: OperatorProcess
) -> None:
    api_cluster.create_region("big", **largest_spec())
    status = api_cluster.wait_phase("big", "Failed", timeout=60)
    assert len(status["message"]) <= 4096
    for condition in status["conditions"]:
        assert len(condition["message"]) <= 32768
    api_cluster.delete_region("big")
    api_cluster.wait_gone("big", timeout=30)


def test_regions_refused_for_capacity_create_nothing_and_delete_promptly(
    api_cluster: Cluster, api_operator: OperatorProcess, small_tmpfs: Path, tmp_path: Path
) -> None:
    """1 EiB; more than the node's 64 MiB root; more than free space less the reserve."""
    root = small_tmpfs / "node-a"
    reserve = str(48 * 2**20)
    agent = Agent("node-a", root, api_cluster.kubeconfig, tmp_path, "--reserve-bytes", reserve)
    agent.start()
    try:
        wait_for(
            lambda: ((api_cluster.offload_node("node-a") or {}).get("status") or {}).get(
                "capacityBytes"
            ),
            30,
            "the agent to measure its root",
        )
        blocks = {"huge": 2**44, "larger-than-node": 2048, "over-the-reserve": 512}  # x 64 KiB
        for name, num_blocks in blocks.items():
            api_cluster.create_region(
                name,
                layout={"numBlocks": num_blocks, "cpuPageSize": 65536},
                placement={"nodeNames": ["node-a"]},
            )
        for name in blocks:
            api_cluster.wait_phase(name, "Failed", timeout=60)
        wait_for(
            lambda: all(
                (api_cluster.status(name).get("nodes") or {}).get("node-a", {}).get("phase")
                == "Failed"
                for name in ("over-the-reserve",)
            ),
            30,
            "the agent to refuse the region over its reserve",
        )
        assert (
            "not enough room"
            in api_cluster.status("over-the-reserve")["nodes"]["node-a"]["message"]
        )
        assert not (root / api_cluster.namespace).exists(), list(root.rglob("*"))
        for name in blocks:
            api_cluster.delete_region(name)
        for name in blocks:
            api_cluster.wait_gone(name, timeout=15)
        assert not (root / api_cluster.namespace).exists(), list(root.rglob("*"))
    finally:
        agent.stop()


def test_a_node_deleted_under_a_live_agent_degrades_its_regions(
    api_cluster: Cluster, api_agents: dict[str, Agent], api_operator: OperatorProcess
) -> None:
    api_cluster.create_region("named", placement={"nodeNames": ["node-a"]})
    api_cluster.create_region("everywhere")
    for name in ("named", "everywhere"):
        api_cluster.wait_phase(name, "Ready", timeout=60)
    api_cluster.delete_node("node-a")
    for name in ("named", "everywhere"):
        status = api_cluster.wait_phase(name, "Degraded", timeout=30)
        assert status["nodes"]["node-a"]["phase"] == "Ready"
        assert "node-a" in status["message"] and "deleted" in status["message"], status
    deadline = time.monotonic() + 5  # and it stays so (the resync runs every second)
    while time.monotonic() < deadline:
        assert {api_cluster.phase("named"), api_cluster.phase("everywhere")} == {"Degraded"}
        time.sleep(0.5)
    assert api_agents["node-a"].files() == [
        region_file(api_cluster, n) for n in ("everywhere", "named")
    ]


def test_ready_only_when_every_node_reports_the_current_generation(
    api_cluster: Cluster, api_agents: dict[str, Agent], api_operator: OperatorProcess
) -> None:
    """observedGeneration round trip: the agents write the generation they acted on, the CRD
    keeps it, and the operator calls the region Ready only for the current one."""
    api_cluster.create_region("r1")
    status = api_cluster.wait_phase("r1", "Ready", timeout=60)
    assert {n["observedGeneration"] for n in status["nodes"].values()} == {1}
    for agent in api_agents.values():
        agent.stop()  # the reports stay as they are: generation 1
    api_cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, api_cluster.namespace, REGION_PLURAL, "r1", {"spec": {"lock": False}}
    )
    status = wait_for(
        lambda: (s := api_cluster.status("r1")).get("observedGeneration") == 2 and s,
        30,
        "the operator to act on generation 2",
    )
    assert status["phase"] != "Ready" and status["nodesReady"] == 0, status
    assert {n["observedGeneration"] for n in status["nodes"].values()} == {1}
    for agent in api_agents.values():
        agent.start()
    status = api_cluster.wait_phase("r1", "Ready", timeout=60)
    assert status["observedGeneration"] == 2
    assert {n["observedGeneration"] for n in status["nodes"].values()} == {2}
    assert {n["locked"] for n in status["nodes"].values()} == {False}


def test_an_api_server_restart_under_running_agents_and_operator(
    envtest: EnvTest,
    api_cluster: Cluster,
    api_agents: dict[str, Agent],
    api_operator: OperatorProcess,
) -> None:
    api_cluster.create_region("before")
    api_cluster.wait_phase("before", "Ready", timeout=60)
    envtest.stop_apiserver()
    time.sleep(3)  # every watch breaks; agents and operator retry
    envtest.start_apiserver()
    api_cluster.create_region("after")
    api_cluster.wait_phase("after", "Ready", timeout=90)
    # An outage longer than the agents' silence limit (6 s here; a restart on a loaded 2-core
    # runner takes that long) rightly degrades "before" while nothing is heard from its agents;
    # what must hold is that it comes back to Ready once they report again.
    api_cluster.wait_phase("before", "Ready", timeout=60)
    processes = [a.process for a in api_agents.values()] + [api_operator.process]
    assert all(p is not None and p.poll() is None for p in processes)
    for agent in api_agents.values():
        assert agent.files() == [region_file(api_cluster, n) for n in ("after", "before")]


def test_no_record_a_regions_author_can_forge_releases_it(
    api_cluster: Cluster, api_agents: dict[str, Agent], api_operator: OperatorProcess
) -> None:
    """The operator keeps no kopf records in a region (each was a write): a release is decided
    from the agents' reports alone, whatever the region's annotations say."""
    agent = api_agents["node-a"]
    agent.stop()
    agent.extra = ("--drain-grace-seconds", "120")  # it waits for the holder below, not 2 s
    agent.start()
    api_cluster.create_region("r1")
    api_cluster.wait_phase("r1", "Ready", timeout=60)
    held = agent.root / api_cluster.namespace / "r1"
    holder = Holder(held, "r1", mode="attach")  # a serving pod: the deletion must wait for it
    try:
        api_cluster.delete_region("r1")
        api_cluster.wait_phase("r1", "Terminating", timeout=30)
        region = api_cluster.region("r1")
        assert region is not None
        assert "kopf" not in region["status"]
        assert not [a for a in region["metadata"].get("annotations", {}) if "kvshm.dev" in a]
        # what an author may write: a record of release as done, where kopf used to keep it
        done = {"started": "2026-01-01T00:00:00", "stopped": "2026-01-01T00:00:01"}
        done |= {"purpose": "delete", "retries": 1, "success": True, "failure": False}
        forged = {"kvshm.dev/release": json.dumps(done), "kvshm.dev/kopf-managed": "yes"}
        api_cluster.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            api_cluster.namespace,
            REGION_PLURAL,
            "r1",
            {"metadata": {"annotations": forged}},
        )
        time.sleep(3 * TEST_CONFIG.deletion_poll_seconds + 1)  # several re-checks of the drain
        region = api_cluster.region("r1")
        assert region is not None, "released while a process still held the region"
        assert FINALIZER in region["metadata"]["finalizers"]
    finally:
        holder.kill()
    api_cluster.wait_gone("r1", timeout=30)


def test_an_operator_started_over_more_nodes_than_kopf_had_workers_gets_regions_ready(
    api_cluster: Cluster, api_agents: dict[str, Agent], operator_kubeconfig: Path, tmp_path: Path
) -> None:
    """kopf's workers wait, holding their slots, until every object of every kind listed at
    start is indexed: with the old limit of 256 workers, 300 Nodes deadlocked the operator at
    start (it read watch events into memory and did nothing: 1.9 GB after 15 minutes)."""
    for index in range(300):
        api_cluster.add_node(f"idle-{index:03d}")
    api_cluster.create_region("r1", placement={"nodeNames": ["node-a"]})
    operator = OperatorProcess(operator_kubeconfig, tmp_path).start()
    try:
        api_cluster.wait_phase("r1", "Ready", timeout=90)
    finally:
        operator.kill()
