"""The agent's cluster-mode fixtures: the real API server (tests/envtest), a fresh namespace,
and the admin's view of it; agents authenticate as the chart's agent ServiceAccount."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pytest import fixture

from tests.agent.cluster import AgentCluster
from tests.envtest.server import EnvTest


@fixture
def cluster(
    envtest: EnvTest, envtest_namespace: str, agent_kubeconfig: Path
) -> Iterator[AgentCluster]:
    result = AgentCluster(envtest.api_client(), agent_kubeconfig, envtest_namespace)
    result.clear_events("default")  # Nodes' and OffloadNodes' Events of earlier tests
    yield result
    result.close()
