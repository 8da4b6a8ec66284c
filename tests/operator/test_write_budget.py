"""The operator's own API writes per region, counted from the real API server's audit log: at
most WRITE_BUDGET from create to Ready, and again from delete to gone. Each write is
API server and etcd capacity the cluster's other controllers need; the agents' own writes are
not counted here."""

from __future__ import annotations

from collections import Counter

from bench.operator.fleet import Fleet

from tests.envtest.audit import AuditLog, describe, service_account_user, writes_by_region
from tests.envtest.fixtures import CHART_NAMESPACE, ChartAccounts
from tests.envtest.server import EnvTest
from tests.operator.harness import Agent, Cluster, OperatorProcess
from tests.waiting import wait_for

WRITE_BUDGET = 4
OPERATOR_USER = service_account_user(CHART_NAMESPACE, "kvshm-operator")
REGIONS = 4


def _within_budget(audit: AuditLog, start: int, cluster: Cluster, names: list[str]) -> None:
    """Every region of `names` got at least one and at most WRITE_BUDGET operator writes since
    `start` (at least one: the finalizer's addition or removal is always the operator's)."""
    entries = audit.settled(start, OPERATOR_USER)
    counts = writes_by_region(entries, OPERATOR_USER)
    writes = {name: counts[(cluster.namespace, name)] for name in names}
    made_of: Counter[str] = describe(entries, OPERATOR_USER)
    told = f"operator writes per region {writes} (budget {WRITE_BUDGET}): {dict(made_of)}"
    assert all(writes.values()) and max(writes.values()) <= WRITE_BUDGET, told


def _up_and_down(
    audit: AuditLog, cluster: Cluster, names: list[str], placements: list[list[str] | None]
) -> None:
    """Create the regions, measure to all Ready; delete them, measure to all gone."""
    start = audit.mark()
    for name, nodes in zip(names, placements, strict=True):
        cluster.create_region(name, **({"placement": {"nodeNames": nodes}} if nodes else {}))
    for name in names:
        cluster.wait_phase(name, "Ready", timeout=60)
    for name in names:  # the Ready Event is posted after the status write
        wait_for(
            lambda name=name: "Ready" in {e["reason"] for e in cluster.events(name)},
            30,
            f"the Ready Event of {name}",
        )
    _within_budget(audit, start, cluster, names)
    start = audit.mark()
    for name in names:
        cluster.delete_region(name)
    for name in names:
        cluster.wait_gone(name, timeout=60)
    _within_budget(audit, start, cluster, names)


def test_the_operator_writes_a_region_at_most_4_times_each_way(
    envtest: EnvTest,
    api_cluster: Cluster,
    api_agents: dict[str, Agent],
    api_operator: OperatorProcess,
) -> None:
    """Regions on both nodes (each agent reports twice on the way up), created together."""
    names = [f"r{index}" for index in range(REGIONS)]
    _up_and_down(envtest.audit_log, api_cluster, names, [None] * len(names))


def test_the_budget_holds_against_agents_that_report_at_once(
    envtest: EnvTest,
    chart_accounts: ChartAccounts,
    api_cluster: Cluster,
    api_operator: OperatorProcess,
) -> None:
    """Simulated agents (bench/operator/fleet.py, as the chart's agent) report Creating and
    Ready the moment a region appears, and Removed the moment it is deleted: their writes land
    between any two of the operator's, which is what made kopf's finalizer patch fail twice."""
    nodes = ["sim-a", "sim-b"]
    fleet = Fleet(envtest.configuration(chart_accounts.token("agent")), nodes, workers=4)
    fleet.register(api_cluster.core)
    fleet.start()
    names = [f"f{index}" for index in range(20)]
    try:
        _up_and_down(envtest.audit_log, api_cluster, names, [[nodes[i % 2]] for i in range(20)])
    finally:
        fleet.stop()
    reports = [fleet.errors.get() for _ in range(fleet.errors.qsize())]
    assert not [error for error in reports if error.startswith("report")], reports
