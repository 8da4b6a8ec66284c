"""The OffloadNode's inventory is bounded, and the heartbeat never waits on it.

A tenant owns its region directories and can fill each with 64 region-shaped names: 160 of
them made a status of 10,240 entries, over the CRD's maxItems (and, with long names, over
etcd's request size), so the one status patch (inventory and heartbeat) was refused every
time and the operator took the agent for silent.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes

from kvshm.agent.cluster.sink import ClusterSink
from kvshm.agent.inventory import (
    MAX_PUBLISHED_BYTES,
    MAX_PUBLISHED_FILES,
    RootScan,
    published_files,
)
from kvshm.agent.reports import PassResult
from kvshm.api import GROUP, NODE_PLURAL, VERSION, InventoryFile, NodeInventory, NodeName
from kvshm.api.offload_node import parse_offload_node
from kvshm.api.reading import parse_timestamp
from kvshm.operator.orphans import OrphanClock, decide_reclaims
from tests.agent.builders import manifest, region_dir
from tests.agent.cluster import AgentCluster, running_agent
from tests.envtest import manifests
from tests.envtest.fixtures import ChartAccounts
from tests.envtest.server import EnvTest
from tests.waiting import wait_for

NODE = "node-a"


def junk(namespace: str, region: str, count: int) -> list[InventoryFile]:
    return [
        InventoryFile(f"{namespace}/{region}/vllm_offload_junk{i:02d}.mmap", 0, "", False)
        for i in range(count)
    ]


def test_one_namespaces_junk_leaves_the_others_and_the_operators_paths_listed() -> None:
    flood = [f for r in range(100) for f in junk("flood", f"r{r:03d}", 64)]
    claimed = InventoryFile("flood/r099/vllm_offload_r099.mmap", 4096, "flood/r099", True)
    quiet = [
        InventoryFile(f"quiet/q{i}/vllm_offload_q{i}.mmap", 4096, f"quiet/q{i}", False)
        for i in range(3)
    ]
    retained = "flood/r050/vllm_offload_junk63.mmap"  # the last name of its directory
    published = published_files([*flood, claimed, *quiet], {retained}, max_files=200)
    paths = [f.path for f in published.files]
    assert len(paths) == 200 and paths == sorted(paths)
    assert retained in paths
    assert {f.path for f in quiet} <= set(paths)
    assert claimed.path in paths  # a region's own file before the junk of its directory
    # the flood's share is spread over its directories, one name of each per round
    per_dir = {p.split("/")[1] for p in paths if p.startswith("flood/")}
    assert len(per_dir) == 100
    assert published.omitted == {"flood": len(flood) + 1 + 3 - 200}
    assert published.omitted_count == len(flood) + 1 + 3 - 200


def test_the_byte_bound_holds_for_the_longest_names() -> None:
    namespace, region = "n" * 63, "r" * 253
    files = [
        InventoryFile(f"{namespace}/{region}{i}/vllm_offload_{'i' * 120}.mmap", 1, "", False)
        for i in range(5000)
    ]
    published = published_files(files)
    size = len(json.dumps([f.to_status() for f in published.files]))
    assert size <= MAX_PUBLISHED_BYTES
    assert len(published.files) > 900 and published.omitted_count == 5000 - len(published.files)
    assert len(published_files(files[:100]).files) == 100  # under the bounds: everything


def test_a_flooded_root_keeps_the_heartbeat_and_retained_files_listed(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    """160 directories of 64 junk names each, the real agent, the real API server: the
    inventory published fits, the heartbeat goes on, a retained file sorted last in its flooded
    directory is listed (the operator would otherwise forget it was retained), and the
    OffloadNode says what was left out."""
    cluster.add_node(NODE)
    namespace = cluster.namespace
    root = shm_dir / "root"
    for index in range(160):
        directory = region_dir(root, f"flood/r{index:03d}")
        # r007 holds the retained file too, last of its 61 names (all listed by the scan)
        for name in range(64 if index != 7 else 60):
            fd = os.open(directory / f"vllm_offload_junk{name:02d}.mmap", os.O_CREAT | os.O_WRONLY)
            os.close(fd)
    retained = "flood/r007/vllm_offload_zz-retained.mmap"
    (root / retained).write_bytes(b"\0" * 4096)
    cluster.custom.create_cluster_custom_object(
        GROUP,
        VERSION,
        NODE_PLURAL,
        manifests.offload_node(NODE, {"retained": [{"path": retained, "region": "flood/gone"}]}),
    )
    cluster.create(manifest("llm", namespace))
    with running_agent(cluster.kubeconfig, NODE, root) as app:
        wait_for(lambda: cluster.phase_on("llm", NODE) == "Ready", 60, "Ready")
        first = wait_for(lambda: cluster.node_status_of(NODE).get("heartbeat"), 30, "a heartbeat")
        # resync 1 s: the heartbeat moves (to the second) once a pass over the flooded root,
        # a second or more on a busy machine, finds it due
        wait_for(
            lambda: cluster.node_status_of(NODE).get("heartbeat") != first, 30, "a new heartbeat"
        )
        status = cluster.node_status_of(NODE)
        omitted = app.metrics.registry.get_sample_value("kvshm_agent_inventory_omitted_files")
    assert omitted is not None and omitted == 160 * 64 - 4 + 2 - len(status["files"])
    assert status["heartbeat"] != first
    files = status["files"]
    assert len(files) <= MAX_PUBLISHED_FILES
    assert len(json.dumps(files)) <= MAX_PUBLISHED_BYTES
    paths = {f["path"] for f in files}
    assert retained in paths
    assert f"{namespace}/llm/vllm_offload_llm.mmap" in paths
    condition = next(c for c in status["conditions"] if c["type"] == "InventoryComplete")
    assert condition["status"] == "False" and condition["reason"] == "Capped"
    assert "in flood" in condition["message"] and "entries not listed" in condition["message"]

    # the operator's sweep over what was published keeps the retention and requests reclaims
    # only for files it was shown
    stored = cluster.offload_node(NODE)
    assert stored is not None
    node = parse_offload_node(stored)
    assert node is not None
    now = datetime.now(UTC) + timedelta(days=1)
    decision = decide_reclaims(node, [], OrphanClock(), now, grace_seconds=0)
    assert retained not in decision.forget_retained
    assert {due.path for due in decision.requests} <= paths - {retained}


def test_a_refused_inventory_leaves_the_heartbeat_going(
    envtest: EnvTest, chart_accounts: ChartAccounts, envtest_admin: kubernetes.client.ApiClient
) -> None:
    """When the API server refuses the whole status anyway (here: an entry the CRD refuses),
    the heartbeat goes alone, the inventory last accepted stays, and a condition says why."""
    errors: list[object] = []
    node = NodeName("node-refused")
    sink = ClusterSink(
        envtest.api_client(chart_accounts.token("agent")),
        node,
        "test",
        count_error=errors.append,
        heartbeat_seconds=0,
    )
    sink.ensure_node()
    good = InventoryFile("ns/a/vllm_offload_a.mmap", 4096, "", False)
    sink.publish(PassResult(root_scan=RootScan("/r", NodeInventory(1 << 30, 1 << 29, 0, (good,)))))
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)

    def stored() -> dict[str, object]:
        body = custom.get_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, node)
        return body["status"]  # type: ignore[no-any-return]

    first = parse_timestamp(stored()["heartbeat"])
    assert first is not None and errors == []
    time.sleep(1.1)
    too_long = InventoryFile("ns/b/vllm_offload_" + "b" * 1100 + ".mmap", 1, "", False)
    inventory = NodeInventory(1 << 30, 1 << 28, 0, (good, too_long))
    sink.publish(PassResult(root_scan=RootScan("/r", inventory)))
    after = stored()
    heartbeat = parse_timestamp(after["heartbeat"])
    assert heartbeat is not None and heartbeat > first
    assert after["freeBytes"] == 1 << 28
    assert [f["path"] for f in after["files"]] == [good.path]  # type: ignore[attr-defined]
    conditions = {c["type"]: c for c in after["conditions"]}  # type: ignore[attr-defined]
    refused = conditions["InventoryComplete"]
    assert refused["status"] == "False" and refused["reason"] == "NotPublished"
    assert "422" in refused["message"] and "inventory stays as last accepted" in refused["message"]
    kubernetes.client.CustomObjectsApi(envtest_admin).delete_cluster_custom_object(
        GROUP, VERSION, NODE_PLURAL, node
    )
