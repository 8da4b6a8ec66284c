"""The agent's status sink against a real kube-apiserver, as the chart's agent ServiceAccount:
what it writes is accepted, with names as long as Kubernetes allows."""

from __future__ import annotations

import kubernetes
import pytest

from kvshm.agent.cluster.sink import ClusterSink
from kvshm.agent.errors import ErrorReason
from kvshm.agent.reports import AgentEvent, EventReason, PassResult
from kvshm.api import GROUP, REGION_PLURAL, VERSION
from tests.envtest.fixtures import ChartAccounts
from tests.envtest.server import EnvTest

# The longest names Kubernetes allows: a Node (and so an OffloadNode) and a region, each a DNS
# subdomain of 253 characters.
LONGEST_NODE = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
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
    region = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadRegion",
        "metadata": {"name": LONGEST_REGION},
        "spec": {"instanceId": "r1", "layout": {"numBlocks": 1, "cpuPageSize": 4096}},
    }
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
