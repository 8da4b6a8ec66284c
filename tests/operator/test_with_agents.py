"""The operator in kopf's runtime, against a real API server (tests/envtest) with the chart's
operator ServiceAccount, beside two real agents on tmpfs with the chart's agent ServiceAccount.

Each test drives the whole loop: a region is applied, the agents make real files and report,
the operator aggregates, decides and releases. Timings come from harness.TEST_CONFIG.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import time
import urllib.request
from pathlib import Path

from kvshm.operator.metrics import sample
from tests.operator.harness import (
    TEST_CONFIG,
    Agent,
    Cluster,
    Holder,
    OperatorProcess,
    operator_in_loop,
    operator_in_thread,
)
from tests.waiting import wait_for

GRACE = TEST_CONFIG.orphan_grace_seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def region_file(cluster: Cluster, name: str) -> str:
    return f"{cluster.namespace}/{name}/vllm_offload_{name}.mmap"


def inventory(cluster: Cluster, node: str) -> dict[str, dict]:  # type: ignore[type-arg]
    status = (cluster.offload_node(node) or {}).get("status") or {}
    return {entry["path"]: entry for entry in status.get("files") or ()}


def requested(cluster: Cluster, node: str) -> set[str]:
    spec = (cluster.offload_node(node) or {}).get("spec") or {}
    return {entry["path"] for entry in spec.get("reclaims") or ()}


def test_apply_makes_files_on_both_nodes_and_ready(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    with operator_in_thread():
        cluster.create_region("r1")
        status = cluster.wait_phase("r1", "Ready")
        assert (status["nodesReady"], status["nodesWanted"]) == (2, 2)
        assert status["sizeBytes"] == 16 * 65536
        assert status["observedGeneration"] == 1
        assert cluster.condition("r1", "Ready")["status"] == "True"
        region = cluster.region("r1")
        assert region is not None
        assert region["metadata"]["finalizers"] == ["kvshm.dev/operator"]
        cluster.wait_events("r1", "Ready")
    for agent in agents.values():
        assert agent.files() == [region_file(cluster, "r1")]


async def test_invalid_specs_get_a_clear_condition_and_no_files(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    """In-loop: kopf.operator() as a task of this test's event loop."""
    invalid = {
        "ghost": ({"placement": {"nodeNames": ["node-ghost"]}}, "UnknownNode", "node-ghost"),
        "nomatch": (
            {"placement": {"nodeSelector": {"kvshm.dev/pool": "cpu"}}},
            "NoMatchingNode",
            "label a node",
        ),
        # 64 MiB roots: 2 GiB fits on no node
        "huge": (
            {"layout": {"numBlocks": 32768, "cpuPageSize": 65536}},
            "InsufficientCapacity",
            "numBlocks",
        ),
    }
    async with operator_in_loop():
        for name, (spec, _, _) in invalid.items():
            await asyncio.to_thread(cluster.create_region, name, **spec)
        for name, (_, reason, hint) in invalid.items():
            await asyncio.to_thread(cluster.wait_phase, name, "Failed")
            accepted = await asyncio.to_thread(cluster.condition, name, "Accepted")
            assert (accepted["status"], accepted["reason"]) == ("False", reason)
            assert hint in accepted["message"]
            await asyncio.to_thread(
                wait_for,
                lambda name=name, reason=reason, hint=hint: any(
                    e["reason"] == reason and hint in e["message"] for e in cluster.events(name)
                ),
                10,
                f"a {reason} Event for {name} (events: {cluster.events(name)})",
            )
        await asyncio.sleep(2)  # time enough for an agent to have acted, were it going to
    for agent in agents.values():
        assert agent.files() == []
    for name in ("ghost", "nomatch"):
        assert "nodes" not in cluster.status(name)  # no agent took these regions


def test_delete_waits_for_the_drain_then_files_are_gone_then_the_finalizer(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    with operator_in_thread():
        cluster.create_region("r1")
        cluster.wait_phase("r1", "Ready")
        # a serving process still attached on node-a: its agent drains for the grace period
        holder = Holder(agents["node-a"].root / cluster.namespace / "r1", "r1", mode="attach")
        try:
            cluster.delete_region("r1")
            cluster.wait_phase("r1", "Terminating")
            draining = wait_for(
                lambda: (
                    cluster.condition("r1", "Drained").get("reason") == "Draining"
                    and cluster.condition("r1", "Drained")
                ),
                10,
                "the Drained condition to name the draining node",
            )
            assert draining["status"] == "False" and "node-a" in draining["message"]
            assert cluster.region("r1") is not None  # the finalizer holds it
            assert agents["node-a"].files() == [region_file(cluster, "r1")]
            cluster.wait_gone("r1")
        finally:
            holder.kill()
        for agent in agents.values():
            assert agent.files() == []


def test_retain_releases_at_once_and_keeps_the_files_unreclaimed(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    with operator_in_thread():
        cluster.create_region("kept", reclaimPolicy="Retain")
        cluster.wait_phase("kept", "Ready")
        cluster.delete_region("kept")
        cluster.wait_gone("kept", timeout=10)
        path = region_file(cluster, "kept")
        for node in agents:
            wait_for(
                lambda node=node: inventory(cluster, node).get(path, {}).get("claimedBy") == "",
                10,
                f"{node}'s inventory to list {path} as unclaimed",
            )
            spec = (cluster.offload_node(node) or {}).get("spec") or {}
            assert [entry["path"] for entry in spec.get("retained", [])] == [path]
        time.sleep(GRACE + 3)  # well past the orphan grace period
        for node, agent in agents.items():
            assert agent.files() == [path]
            assert path not in requested(cluster, node)


def test_an_orphan_of_a_killed_process_is_reclaimed_after_the_grace_period_not_before(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    node, agent = "node-a", agents["node-a"]
    path = region_file(cluster, "ghost")
    requested_before = sample("kvshm_operator_reclaims_requested_total")
    completed_before = sample("kvshm_operator_reclaims_completed_total")
    with operator_in_thread():
        Holder(agent.root / cluster.namespace / "ghost", "ghost").kill()  # created, then killed
        killed = time.monotonic()  # its time as an orphan cannot start before this
        wait_for(
            lambda: inventory(cluster, node).get(path, {}).get("held") is False,
            10,
            "the agent to list the file as not held",
        )
        while time.monotonic() < killed + GRACE - 0.1:  # not before the grace period
            assert agent.files() == [path]
            assert path not in requested(cluster, node)
            time.sleep(0.1)
        wait_for(lambda: agent.files() == [], GRACE + 10, "the orphan to be reclaimed")
        assert time.monotonic() - killed <= GRACE + 12
        wait_for(lambda: not requested(cluster, node), 10, "the answered request to be closed")
        cluster.wait_events(node, "ReclaimRequested", "ReclaimCompleted")
    assert sample("kvshm_operator_reclaims_requested_total") - requested_before == 1
    assert sample("kvshm_operator_reclaims_completed_total") - completed_before == 1


def test_a_held_file_is_never_reclaimed(cluster: Cluster, agents: dict[str, Agent]) -> None:
    node, agent = "node-b", agents["node-b"]
    path = region_file(cluster, "stray")
    refused_before = sample("kvshm_operator_decisions_refused_total", {"reason": "held"})
    holder = Holder(agent.root / cluster.namespace / "stray", "stray")  # no region claims it
    try:
        with operator_in_thread():
            wait_for(lambda: path in inventory(cluster, node), 10, "the file in the inventory")
            assert inventory(cluster, node)[path]["held"] is True
            deadline = time.monotonic() + GRACE + 3  # past the grace period
            while time.monotonic() < deadline:
                assert path not in requested(cluster, node)
                time.sleep(0.2)
            assert agent.files() == [path]
    finally:
        holder.kill()
    assert sample("kvshm_operator_decisions_refused_total", {"reason": "held"}) > refused_before


def test_an_operator_killed_mid_deletion_finishes_the_job_after_a_restart(
    cluster: Cluster, agents: dict[str, Agent], operator_kubeconfig: Path, tmp_path: Path
) -> None:
    operator = OperatorProcess(operator_kubeconfig, tmp_path).start()
    try:
        cluster.create_region("r1")
        cluster.wait_phase("r1", "Ready", timeout=60)
        holder = Holder(agents["node-a"].root / cluster.namespace / "r1", "r1", mode="attach")
        cluster.delete_region("r1")
        cluster.wait_phase("r1", "Terminating")
        operator.kill()  # SIGKILL: no clean-up, the finalizer stays
        holder.kill()
        for node in agents:
            wait_for(
                lambda node=node: cluster.status("r1")["nodes"][node]["phase"] == "Removed",
                20,
                f"{node} to remove its files",
            )
        time.sleep(1)
        assert cluster.region("r1") is not None, "released without an operator"
        operator.start()
        cluster.wait_gone("r1", timeout=60)
    except BaseException:
        print(operator.output()[-6000:])
        raise
    finally:
        operator.kill()
    for agent in agents.values():
        assert agent.files() == []


def test_a_silent_agent_degrades_the_region_with_a_reason(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    with operator_in_thread():
        cluster.create_region("r1")
        cluster.wait_phase("r1", "Ready")
        process = agents["node-b"].process
        assert process is not None
        process.send_signal(signal.SIGSTOP)
        try:
            cluster.wait_phase("r1", "Degraded", timeout=TEST_CONFIG.agent_silence_seconds + 10)
            degraded = cluster.condition("r1", "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "AgentSilent")
            assert "node-b" in degraded["message"] and "silent" in degraded["message"]
            cluster.wait_events("r1", "Degraded")
        finally:
            process.send_signal(signal.SIGCONT)
        cluster.wait_phase("r1", "Ready", timeout=20)


def test_a_gone_node_loses_its_offload_node_and_its_place_in_region_status(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    with operator_in_thread():
        cluster.create_region("r1")
        cluster.wait_phase("r1", "Ready")
        agents["node-b"].stop(signal.SIGKILL)
        cluster.delete_node("node-b")
        wait_for(
            lambda: cluster.offload_node("node-b") is None,
            # generous: on CI's 2 busy cores the timers that notice a gone node run late
            TEST_CONFIG.agent_silence_seconds + 45,
            "the OffloadNode of the gone node to be removed",
        )
        wait_for(
            lambda: "node-b" not in (cluster.status("r1").get("nodes") or {}),
            30,
            "node-b to leave the region's status",
        )
        status = cluster.wait_phase("r1", "Ready", timeout=10)
        assert (status["nodesReady"], status["nodesWanted"]) == (1, 1)
        cluster.wait_events("r1", "NodeGone")


def test_dry_run_reports_an_orphan_and_requests_nothing(
    cluster: Cluster, agents: dict[str, Agent]
) -> None:
    node, agent = "node-a", agents["node-a"]
    path = region_file(cluster, "ghost")
    with operator_in_thread(dataclasses.replace(TEST_CONFIG, orphan_dry_run=True)):
        Holder(agent.root / cluster.namespace / "ghost", "ghost").kill()
        wait_for(
            lambda: any(e["reason"] == "WouldReclaim" and path in e["message"]
                        for e in cluster.events(node)),
            GRACE + 10,
            "the dry run's WouldReclaim Event",
        )  # fmt: skip
        time.sleep(1)
        assert not requested(cluster, node)
        assert agent.files() == [path]
        assert sample("kvshm_operator_orphaned_files") >= 1


def test_the_console_script_serves_liveness_and_metrics(
    cluster: Cluster, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    health, scrape = free_port(), free_port()
    config = dataclasses.replace(TEST_CONFIG, metrics_port=scrape)
    args = ("--liveness", f"http://127.0.0.1:{health}/healthz", "--log-level", "debug")
    operator = OperatorProcess(operator_kubeconfig, tmp_path, config, args).start()
    try:

        def get(port: int, path: str) -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
                    return str(answer.read().decode())
            except OSError:
                return ""

        liveness = wait_for(lambda: get(health, "/healthz"), 30, "kopf's liveness endpoint")
        assert "regions" in liveness  # the probe's result
        text = wait_for(lambda: get(scrape, "/metrics"), 10, "/metrics")
        for name in ("kvshm_operator_regions", "kvshm_operator_reconciles_total"):
            assert name in text
    except BaseException:
        print(operator.output()[-6000:])
        raise
    finally:
        operator.kill()
