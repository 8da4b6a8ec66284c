"""The agent and the operator as processes against a real kube-apiserver, each with the token
of the chart's own ServiceAccount (so a permission the chart lacks fails here), beside two
fake Nodes whose agents keep real files on a real tmpfs."""

from __future__ import annotations

from tests.operator.harness import Agent, Cluster, OperatorProcess


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
    for agent in api_agents.values():
        assert agent.files() == [region_file(api_cluster, "r1")]
    api_cluster.delete_region("r1")
    api_cluster.wait_gone("r1", timeout=30)
    for agent in api_agents.values():
        assert agent.files() == []
