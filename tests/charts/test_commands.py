"""The chart's command lines are ones the real programs accept: the DaemonSet's and the
Deployment's args go through kvshm-agent's and kvshm-operator's own argument parsers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvshm.agent.cli import build_parser
from kvshm.operator.main import parse_args
from tests.charts.rendering import EXAMPLE_VALUES, find, render, values_id

ALL_OPTIONS = (
    "agent.hostPID=true",
    "agent.reserveBytes=2Gi",
    "agent.populate.threads=4",
    "agent.populate.rateBytesPerSecond=4Gi",
    "operator.orphans.dryRun=true",
    "operator.watchNamespaces=[serving, batch]",
)


def _container(kind: str, suffix: str, **kwargs: object) -> dict[str, object]:
    workload = find(render(**kwargs), kind, suffix)  # type: ignore[arg-type]
    container: dict[str, object] = workload["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_agent_args_parse(values: Path | None) -> None:
    container = _container("DaemonSet", "-agent", values=values)
    assert container["command"] == ["kvshm-agent"]
    args = [a.replace("$(NODE_NAME)", "gpu-1") for a in container["args"]]  # type: ignore[attr-defined]
    parsed = build_parser().parse_args(args)
    assert parsed.node_name == "gpu-1" and parsed.local is None
    assert parsed.root == "/dev/shm/kvshm" and parsed.port == 9464


def test_agent_options_reach_the_agent() -> None:
    container = _container("DaemonSet", "-agent", sets=ALL_OPTIONS)
    args = [a.replace("$(NODE_NAME)", "gpu-1") for a in container["args"]]  # type: ignore[attr-defined]
    parsed = build_parser().parse_args(args)
    assert parsed.proc_scan is True
    assert parsed.reserve_bytes == 2 * 2**30
    assert parsed.populate_threads == 4
    assert parsed.populate_rate == 4 * 2**30


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_operator_args_parse(values: Path | None) -> None:
    container = _container("Deployment", "-operator", values=values)
    assert container["command"] == ["kvshm-operator"]
    parsed = parse_args(container["args"])  # type: ignore[arg-type]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}  # type: ignore[attr-defined]
    assert int(parsed.metrics_port) == ports["metrics"]
    assert parsed.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    assert parsed.peering_mode == "standalone"
    chosen = {} if values is None else yaml.safe_load(values.read_text())
    assert parsed.namespace == chosen.get("operator", {}).get("watchNamespaces", [])


def test_operator_options_reach_the_operator() -> None:
    container = _container("Deployment", "-operator", sets=ALL_OPTIONS)
    parsed = parse_args(container["args"])  # type: ignore[arg-type]
    assert parsed.namespace == ["serving", "batch"]
    assert parsed.orphan_dry_run is True
    assert float(parsed.orphan_grace_seconds) == 600


def test_log_levels_reach_both_programs() -> None:
    sets = ("agent.logLevel=debug", "operator.logLevel=warning")
    agent = _container("DaemonSet", "-agent", sets=sets)
    operator = _container("Deployment", "-operator", sets=sets)
    agent_args = [a.replace("$(NODE_NAME)", "n") for a in agent["args"]]  # type: ignore[attr-defined]
    assert build_parser().parse_args(agent_args).log_level == "debug"
    assert parse_args(operator["args"]).log_level == "warning"  # type: ignore[arg-type]
