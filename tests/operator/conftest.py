"""Fixtures of the operator's integration tests: a real API server (tests/envtest), two nodes
with real agents on a real tmpfs, and the operator, each with the chart's ServiceAccount token.
Logs of every process are printed when a test fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.envtest.fixtures import CHART_NAMESPACE
from tests.envtest.server import EnvTest
from tests.operator.harness import Agent, Cluster, OperatorProcess, operator_process
from tests.waiting import wait_for

NODES = ("node-a", "node-b")


@pytest.fixture
def cluster(
    api_cluster: Cluster, operator_kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> Cluster:
    """api_cluster, with $KUBECONFIG the chart's operator ServiceAccount: kopf run in this
    process (operator_in_thread/operator_in_loop) logs in with it. Events of earlier tests
    about Nodes (kept in `default` and kvshm-system) are deleted."""
    monkeypatch.setenv("KUBECONFIG", str(operator_kubeconfig))
    for namespace in ("default", CHART_NAMESPACE):
        api_cluster.core.delete_collection_namespaced_event(namespace)
    return api_cluster


@pytest.fixture
def agents(api_agents: dict[str, Agent]) -> dict[str, Agent]:
    """A kvshm-agent process per node (api_agents)."""
    return api_agents


def _agents(
    cluster: Cluster, tmpfs: Path, log_dir: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Agent]]:
    started = {
        node: Agent(node, tmpfs / node, cluster.kubeconfig, log_dir).start() for node in NODES
    }
    for node in NODES:  # both registered (OffloadNode with a heartbeat) before a test begins
        wait_for(
            lambda node=node: ((cluster.offload_node(node) or {}).get("status") or {}).get(
                "heartbeat"
            ),
            30,
            f"the agent on {node} to report",
        )
    yield started
    for agent in started.values():
        agent.stop()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for agent in started.values():
            print(f"----- {agent.node} -----\n{agent.output()[-6000:]}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    setattr(item, "rep_" + report.when, report)  # type: ignore[attr-defined]
    return report


@pytest.fixture
def api_cluster(
    envtest: EnvTest, envtest_namespace: str, agent_kubeconfig: Path
) -> Iterator[Cluster]:
    """The admin's view of a real API server: a fresh namespace, NODES as Node objects."""
    result = Cluster(envtest.api_client(), agent_kubeconfig, envtest_namespace)
    for node in NODES:
        result.add_node(node, {"kvshm.dev/pool": "gpu"})
    yield result
    result.close()


@pytest.fixture
def api_agents(
    api_cluster: Cluster, small_tmpfs: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Agent]]:
    """A kvshm-agent process per node with the chart's agent ServiceAccount token."""
    yield from _agents(api_cluster, small_tmpfs, tmp_path, request)


@pytest.fixture
def api_operator(
    api_cluster: Cluster,
    operator_kubeconfig: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorProcess]:
    """`python -m kvshm.operator` with the chart's operator ServiceAccount token."""
    yield from operator_process(operator_kubeconfig, tmp_path, request)
