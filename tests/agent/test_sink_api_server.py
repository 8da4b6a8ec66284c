"""The agent's status sink against a real kube-apiserver, as the chart's agent ServiceAccount:
what it writes is accepted (with names as long as Kubernetes allows), kept by the CRDs'
pruning, and read back by the operator as written."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import kubernetes
import pytest

from kvshm.agent.cluster.sink import ClusterSink
from kvshm.agent.errors import ErrorReason
from kvshm.agent.inventory import RootScan
from kvshm.agent.reports import AgentEvent, EventReason, PassResult
from kvshm.api import (
    GROUP,
    NODE_PLURAL,
    REGION_PLURAL,
    VERSION,
    HugePages,
    InventoryFile,
    NodeInventory,
    NodeName,
    NodeRegionPhase,
    NodeReport,
    ReclaimOutcome,
    ReclaimResult,
    RootPages,
    WarmIndexReport,
    WarmIndexState,
    parse_node_reports,
    parse_offload_node,
)
from tests.envtest import manifests
from tests.envtest.fixtures import ChartAccounts
from tests.envtest.server import EnvTest

# The longest names Kubernetes allows: a Node (and so an OffloadNode) and a region, each a DNS
# subdomain of 253 characters.
LONGEST_NODE = NodeName(".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]))
LONGEST_REGION = ".".join(["r" * 63, "s" * 63, "t" * 63, "u" * 61])


@pytest.fixture
def agent_sink(envtest: EnvTest, chart_accounts: ChartAccounts) -> ClusterSink:
    errors: list[ErrorReason] = []
    sink = ClusterSink(
        envtest.api_client(chart_accounts.token("agent")),
        LONGEST_NODE,
        "test",
        count_error=errors.append,
    )
    sink.errors = errors  # type: ignore[attr-defined]
    return sink


def test_offload_node_of_a_253_character_node_is_created(agent_sink: ClusterSink) -> None:
    assert agent_sink.ensure_node() == {}


def test_events_about_253_character_names_are_created(
    agent_sink: ClusterSink,
    envtest_admin: kubernetes.client.ApiClient,
    envtest_namespace: str,
) -> None:
    region = manifests.region(LONGEST_REGION, envtest_namespace, instanceId="r1")
    created = kubernetes.client.CustomObjectsApi(envtest_admin).create_namespaced_custom_object(
        GROUP, VERSION, envtest_namespace, REGION_PLURAL, region
    )
    agent_sink.publish(
        PassResult(
            events=[
                AgentEvent(EventReason.RECLAIMED, "about the node"),
                AgentEvent(
                    EventReason.CREATED,
                    "about the region",
                    f"{envtest_namespace}/{LONGEST_REGION}",
                    created["metadata"]["uid"],
                ),
            ]
        )
    )
    assert agent_sink.errors == []  # type: ignore[attr-defined]
    core = kubernetes.client.CoreV1Api(envtest_admin)
    about_node = [
        e for e in core.list_namespaced_event("default").items
        if e.involved_object.name == LONGEST_NODE
    ]  # fmt: skip
    about_region = core.list_namespaced_event(envtest_namespace).items
    assert [e.message for e in about_node] == ["about the node"]
    assert [(e.involved_object.name, e.message) for e in about_region] == [
        (LONGEST_REGION, "about the region")
    ]


def test_every_field_of_a_node_report_survives_the_crd_and_reads_back(
    agent_sink: ClusterSink,
    envtest_admin: kubernetes.client.ApiClient,
    envtest_namespace: str,
) -> None:
    """The status contract: what the agent writes into status.nodes.<node> is kept by the
    CRD's structural pruning, and is what the operator reads."""
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, envtest_namespace, REGION_PLURAL, manifests.region("r1", envtest_namespace)
    )
    report = NodeReport(
        NodeRegionPhase.READY,
        path="/dev/shm/kvshm/ns/r1/vllm_offload_r1.mmap",
        size_bytes=65536,
        populated_bytes=65536,
        locked=True,
        populate_seconds=0.25,
        holders=2,
        message="ready",
        observed_generation=created["metadata"]["generation"],
        warm_index=WarmIndexReport(
            WarmIndexState.COLD,
            "it was written for another identity: model.revision: 'a' -> 'b'",
            0,
            datetime(2026, 11, 29, 4, 0, tzinfo=UTC),
        ),
    )
    agent_sink.publish(PassResult(reports={f"{envtest_namespace}/r1": report}))
    assert agent_sink.errors == []  # type: ignore[attr-defined]
    stored = custom.get_namespaced_custom_object(
        GROUP, VERSION, envtest_namespace, REGION_PLURAL, "r1"
    )
    entry = stored["status"]["nodes"][LONGEST_NODE]
    sent = report.to_status()
    assert {k: entry.get(k) for k in sent} == sent
    assert set(entry) == {*sent, "lastTransitionTime"}
    assert NodeReport.from_status(entry).warm_index == report.warm_index
    read = parse_node_reports(stored["status"])[LONGEST_NODE]
    assert read.last_transition_time is not None
    assert read == replace(report, last_transition_time=read.last_transition_time)
    assert read.ready_for(stored["metadata"]["generation"])

    # a new generation of the spec: the report (about the last one) no longer means Ready
    changed = custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        envtest_namespace,
        REGION_PLURAL,
        "r1",
        {"spec": {"placement": {"nodeNames": [LONGEST_NODE]}}},
    )
    generation = changed["metadata"]["generation"]
    assert generation == report.observed_generation + 1
    stale = parse_node_reports(changed["status"])[LONGEST_NODE]
    assert stale == read and not stale.ready_for(generation)

    # a report without one (a region no longer Ready) removes it: null in a merge patch
    agent_sink.publish(
        PassResult(reports={f"{envtest_namespace}/r1": replace(report, warm_index=None)})
    )
    stored = custom.get_namespaced_custom_object(
        GROUP, VERSION, envtest_namespace, REGION_PLURAL, "r1"
    )
    assert "warmIndex" not in stored["status"]["nodes"][LONGEST_NODE]


def test_every_field_of_the_inventory_survives_the_crd_and_reads_back(
    agent_sink: ClusterSink, envtest_admin: kubernetes.client.ApiClient
) -> None:
    """The status contract for the OffloadNode: what the agent publishes is kept by the CRD's
    pruning, and the operator reads back the very records the agent wrote."""
    agent_sink.ensure_node()
    first_seen = datetime.now(UTC) - timedelta(hours=2)
    orphan = InventoryFile(
        "ns/old/vllm_offload_old.mmap", 8192, "", False, 7200.4, first_seen, files=2
    )
    claimed = InventoryFile("ns/r1/vllm_offload_r1.mmap", 65536, "ns/r1", True, 12)
    inventory = NodeInventory(1 << 30, 1 << 29, 1 << 20, (orphan, claimed))
    result = ReclaimResult(
        "ns/gone/vllm_offload_gone.mmap", ReclaimOutcome.REFUSED_HELD, "pid 7", first_seen
    )
    agent_sink.publish(
        PassResult(
            root_scan=RootScan("/dev/shm/kvshm", inventory, ("a FIFO",)),
            reclaims={result.path: result},
        )
    )
    assert agent_sink.errors == []  # type: ignore[attr-defined]
    stored = kubernetes.client.CustomObjectsApi(envtest_admin).get_cluster_custom_object(
        GROUP, VERSION, NODE_PLURAL, LONGEST_NODE
    )
    node = parse_offload_node(stored)
    assert node is not None and node.name == LONGEST_NODE
    read = node.status
    assert read.heartbeat is not None and read.agent_version == "test"
    written = replace(inventory, reclaims=(result,), heartbeat=read.heartbeat, agent_version="test")
    assert read == written
    assert read.files[0].orphaned_since == first_seen.replace(microsecond=0)
    assert stored["status"]["conditions"][0]["type"] == "RootSafe"


def test_an_unchanged_inventory_is_not_sent_again_before_the_heartbeat_is_due(
    envtest: EnvTest, chart_accounts: ChartAccounts, envtest_admin: kubernetes.client.ApiClient
) -> None:
    """Each pass builds the conditions afresh, their transition times at the pass's second: the
    status must be compared with them kept from the last one sent, or every pass writes the
    OffloadNode (an API write per node per pass, for nothing)."""
    errors: list[ErrorReason] = []
    sink = ClusterSink(
        envtest.api_client(chart_accounts.token("agent")),
        NodeName("steady-node"),
        "test",
        count_error=errors.append,
        heartbeat_seconds=3600,
    )
    sink.ensure_node()
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)

    def version() -> str:
        stored = custom.get_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, "steady-node")
        return str(stored["metadata"]["resourceVersion"])

    claimed = InventoryFile("ns/r1/vllm_offload_r1.mmap", 65536, "ns/r1", True, 12)

    def publish(*files: InventoryFile) -> None:
        inventory = NodeInventory(1 << 30, 1 << 29, 1 << 20, files)
        sink.publish(PassResult(root_scan=RootScan("/dev/shm/kvshm", inventory, ("a FIFO",))))

    publish(claimed)
    sent = version()
    time.sleep(1.1)  # the next pass's conditions are made a second later
    publish(claimed)
    assert version() == sent
    publish(claimed, InventoryFile("ns/r2/vllm_offload_r2.mmap", 4096, "ns/r2", False, 1))
    assert version() != sent
    assert errors == []


@pytest.mark.parametrize(
    ("pages", "wanted", "condition"),
    [
        (RootPages(2 << 20, HugePages.WITHIN_SIZE), True, ("True", "HugePages")),
        (RootPages(4096, HugePages.NEVER), True, ("False", "SmallPages")),
        (RootPages(4096, HugePages.NEVER), False, None),  # --huge-pages off: no condition
    ],
    ids=["huge", "small-pages-wanted", "small-pages-off"],
)
def test_the_roots_pages_are_published_with_a_condition_where_huge_pages_are_wanted(
    agent_sink: ClusterSink,
    envtest_admin: kubernetes.client.ApiClient,
    pages: RootPages,
    wanted: bool,
    condition: tuple[str, str] | None,
) -> None:
    agent_sink.ensure_node()
    inventory = NodeInventory(1 << 30, 1 << 29, pages=pages)
    scan = RootScan("/dev/shm/kvshm", inventory, huge_pages_wanted=wanted)
    agent_sink.publish(PassResult(root_scan=scan))
    assert agent_sink.errors == []  # type: ignore[attr-defined]
    stored = kubernetes.client.CustomObjectsApi(envtest_admin).get_cluster_custom_object(
        GROUP, VERSION, NODE_PLURAL, LONGEST_NODE
    )
    node = parse_offload_node(stored)
    assert node is not None and node.status.pages == pages
    found = {c["type"]: c for c in stored["status"]["conditions"]}
    if condition is None:
        assert "HugePages" not in found
        return
    assert (found["HugePages"]["status"], found["HugePages"]["reason"]) == condition
    if condition[0] == "False":
        assert (
            "Mount a tmpfs with huge=within_size at /dev/shm/kvshm" in found["HugePages"]["message"]
        )
