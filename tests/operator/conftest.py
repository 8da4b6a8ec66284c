"""Fixtures of the operator's integration tests: emulator, two nodes with real agents on a real
tmpfs, and the operator. Logs of every process are printed when a test fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.runner import KubeApi
from tests.operator.harness import NAMESPACE, Agent, Cluster
from tests.waiting import wait_for

NODES = ("node-a", "node-b")


@pytest.fixture
def cluster(
    kube_api: KubeApi, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    result = Cluster(kube_api.api_client(), kubeconfig)
    result.core.create_namespace({"metadata": {"name": NAMESPACE}})
    for node in NODES:
        result.add_node(node, {"kvshm.dev/pool": "gpu"})
    yield result
    result.close()
    assert kube_api.handler.failures == [], "the emulator failed on some request"


@pytest.fixture
def agents(
    cluster: Cluster, small_tmpfs: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Agent]]:
    """A kvshm-agent per node, each with its own root on one real 64 MiB tmpfs."""
    started = {
        node: Agent(node, small_tmpfs / node, cluster.kubeconfig, tmp_path).start()
        for node in NODES
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
