"""A real Prometheus scraping a real agent (local mode), a real operator (against a real API
server, tests/envtest, as the chart's operator ServiceAccount) and a serving process moving
blocks with kvshm.transfer; then every dashboard panel's query and every dashboard variable
returns data from it: no PromQL error, no empty panel, at least one finite value each."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.charts.rendering import find, render
from tests.charts.tools import run
from tests.envtest.chart import apply, ensure_namespace
from tests.envtest.fixtures import ChartAccounts, clean_up
from tests.monitoring.dashboards import queries, variable_queries
from tests.monitoring.processes import Background, free_port, http_ok, wait_for
from tests.monitoring.prometheus_server import PrometheusServer

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODE = "e2e-node"
NAMESPACE = "serving"
# small regions: 64 blocks x 64 KiB x 2 workers = 8 MiB each
LAYOUT = {"numBlocks": 64, "cpuPageSize": 65536, "numWorkers": 2}
REGION_BYTES = 64 * 65536 * 2
JOBS = ("kvshm-agent", "kvshm-operator", "serving")


def region_manifest(name: str) -> dict[str, object]:
    return {
        "apiVersion": "kvshm.dev/v1alpha1",
        "kind": "OffloadRegion",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"instanceId": name, "layout": LAYOUT, "populate": True, "lock": False},
    }


def offload_node_manifest() -> dict[str, object]:
    return {"apiVersion": "kvshm.dev/v1alpha1", "kind": "OffloadNode", "metadata": {"name": NODE}}


@dataclass
class Stack:
    prometheus: PrometheusServer
    agent: Background
    operator: Background
    serving: Background
    # where the chart's Services would be: agent, operator metrics, operator health
    addresses: dict[str, str]


def _write_region(directory: Path, name: str) -> None:
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(region_manifest(name)))


def _make_orphan(root: Path) -> None:
    """A region-shaped file no OffloadRegion claims (what a deleted region's crash leaves)."""
    directory = root / NAMESPACE / "gone"
    directory.mkdir(parents=True, mode=0o700)
    path = directory / "vllm_offload_gone.mmap"
    path.write_bytes(b"\0" * 65536)
    path.chmod(0o600)


def _start_operator(accounts: ChartAccounts, work: Path) -> tuple[Background, str, str]:
    kubeconfig = accounts.kubeconfig("operator", work / "kubeconfig")
    port, health = free_port(), free_port()
    operator = Background(
        "operator",
        [
            str(BIN / "kvshm-operator"),
            f"--metrics-port={port}",
            f"--liveness=http://127.0.0.1:{health}/healthz",
            "--peering-mode=standalone",
            "--region-resync-seconds=1",
            "--node-sweep-seconds=1",
            "--all-namespaces",
        ],
        work,
        env={"KUBECONFIG": str(kubeconfig)},
    )
    with accounts.server.api_client() as admin:
        ensure_namespace(admin, NAMESPACE)
        # the node the agent reports for exists, as in a cluster: an OffloadNode with no Node and
        # no heartbeat is a gone node's, which the operator deletes (its sweep then ends)
        apply(admin, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        apply(admin, offload_node_manifest())
        for name in ("llama", "mistral"):
            apply(admin, region_manifest(name))
    wait_for(
        "operator liveness", lambda: http_ok(f"http://127.0.0.1:{health}/healthz"), 30, operator
    )
    return operator, f"127.0.0.1:{port}", f"127.0.0.1:{health}"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, chart_accounts: ChartAccounts
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e")
    root = Path(tempfile.mkdtemp(prefix="kvshm-e2e-root-", dir="/dev/shm"))
    regions = work / "regions"
    regions.mkdir()
    _write_region(regions, "llama")
    _make_orphan(root)
    started: list[Background] = []
    prometheus = None
    try:
        agent_port = free_port()
        agent = Background(
            "agent",
            [
                str(BIN / "kvshm-agent"),
                f"--local={regions}",
                f"--root={root}",
                f"--node-name={NODE}",
                f"--port={agent_port}",
                "--resync-seconds=1",
                "--poll-seconds=0.2",
            ],
            work,
        )
        started.append(agent)
        agent_url = f"http://127.0.0.1:{agent_port}"
        wait_for("agent readiness", lambda: http_ok(f"{agent_url}/readyz"), 30, agent)
        llama_dir = root / NAMESPACE / "llama"
        llama_file = llama_dir / "vllm_offload_llama.mmap"
        wait_for(
            "the agent's llama region",
            lambda: llama_file.exists() and llama_file.stat().st_size == REGION_BYTES,
            30,
            agent,
        )
        operator, operator_address, health_address = _start_operator(chart_accounts, work)
        started.append(operator)
        serving_port = free_port()
        serving = Background(
            "serving",
            [
                sys.executable,
                "-m",
                "tests.monitoring.serving_process",
                f"--dir={llama_dir}",
                "--instance-id=llama",
                f"--num-blocks={LAYOUT['numBlocks']}",
                f"--cpu-page-size={LAYOUT['cpuPageSize']}",
                f"--num-workers={LAYOUT['numWorkers']}",
                f"--port={serving_port}",
            ],
            work,
        )
        started.append(serving)
        node = {"node": NODE}
        prometheus = PrometheusServer(
            work,
            {
                "kvshm-agent": (f"127.0.0.1:{agent_port}", node),
                "kvshm-operator": (operator_address, {}),
                "serving": (
                    f"127.0.0.1:{serving_port}",
                    {**node, "namespace": NAMESPACE, "pod": "llama-0"},
                ),
            },
        )
        wait_for(
            "every target scraped",
            lambda: (
                prometheus.targets_up()
                == dict.fromkeys(("kvshm-agent", "kvshm-operator", "serving"), True)
            ),
            30,
            *started,
        )
        # A region that appears while Prometheus watches: its populate moves the counters.
        _write_region(regions, "mistral")
        addresses = {
            "agent": f"127.0.0.1:{agent_port}",
            "operator-metrics": operator_address,
            "operator-health": health_address,
        }
        yield Stack(prometheus, agent, operator, serving, addresses)
    finally:
        if prometheus is not None:
            prometheus.stop()
        for process in reversed(started):
            process.stop()
        with chart_accounts.server.api_client() as admin:
            clean_up(admin, NAMESPACE)  # the regions (finalizers stripped), the OffloadNode
        shutil.rmtree(root, ignore_errors=True)


def _empty_panels(prometheus: PrometheusServer) -> list[str]:
    return [q.name for q in queries() if not prometheus.finite_values(q.expr)]


def test_every_dashboard_panel_returns_data(stack: Stack) -> None:
    # counters need a few scrapes after the second region's populate; panels fill within seconds
    empty: list[str] = []

    def all_filled() -> bool:
        empty[:] = _empty_panels(stack.prometheus)
        return not empty

    try:
        wait_for(
            "every panel to have data", all_filled, 45, stack.agent, stack.operator, stack.serving
        )
    except AssertionError:
        logs = "\n".join(
            f"--- {p.name}\n{p.log()[-2000:]}" for p in (stack.agent, stack.operator, stack.serving)
        )
        pytest.fail(f"panels without data: {empty}\n{logs}")
    assert len(queries()) > 30


def test_every_dashboard_variable_has_values(stack: Stack) -> None:
    for name, metric, label in variable_queries():
        values = stack.prometheus.api(f"label/{label}/values", **{"match[]": metric})
        assert values, f"{name}: label_values({metric}, {label}) is empty"


def test_the_numbers_are_the_real_ones(stack: Stack) -> None:
    """Spot checks that data is not just present but right."""
    prometheus = stack.prometheus
    sizes = {
        s["metric"]["region"]: float(s["value"][1])
        for s in prometheus.query("kvshm_agent_region_size_bytes")
    }
    assert sizes == {f"{NAMESPACE}/llama": REGION_BYTES, f"{NAMESPACE}/mistral": REGION_BYTES}
    assert prometheus.finite_values("kvshm_agent_orphaned_files") == [1.0]
    moved = prometheus.finite_values('sum(kvshm_transfer_bytes_total{direction="gpu_to_cpu"})')
    assert moved and moved[0] > 0
    assert prometheus.finite_values("sum(kvshm_operator_regions)") == [2.0]


def test_helm_test_pod_passes_against_the_real_programs(stack: Stack) -> None:
    """The `helm test` pod's own check, pointed at these processes instead of the Services."""
    pod = find(render(), "Pod", "-test")
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-c"]
    script = container["args"][0]
    services = {
        "kvshm-agent.kvshm-system.svc:9464": stack.addresses["agent"],
        "kvshm-operator.kvshm-system.svc:9465": stack.addresses["operator-metrics"],
        "kvshm-operator.kvshm-system.svc:8080": stack.addresses["operator-health"],
    }
    for service, address in services.items():
        assert service in script
        script = script.replace(service, address)
    result = run(sys.executable, "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 4
