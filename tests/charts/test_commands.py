"""The chart's command lines are ones the real programs accept: the DaemonSet's args become
kvshm-agent's validated config, the Deployment's go through kvshm-operator's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvshm.agent.cli import parse_config
from kvshm.operator.config import PeeringMode
from kvshm.operator.main import config_from, parse_args
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
    config = parse_config(args, environ={})
    assert config.node_name == "gpu-1" and config.local is None
    assert config.root == "/dev/shm/kvshm" and config.port == 9464


def test_agent_options_reach_the_agent() -> None:
    container = _container("DaemonSet", "-agent", sets=ALL_OPTIONS)
    args = [a.replace("$(NODE_NAME)", "gpu-1") for a in container["args"]]  # type: ignore[attr-defined]
    config = parse_config(args, environ={})
    assert config.proc_scan is True
    assert config.reserve_bytes == 2 * 2**30
    assert config.populate_threads == 4
    assert config.populate_bytes_per_second == 4 * 2**30


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_operator_args_parse(values: Path | None) -> None:
    container = _container("Deployment", "-operator", values=values)
    assert container["command"] == ["kvshm-operator"]
    parsed = parse_args(container["args"])  # type: ignore[arg-type]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}  # type: ignore[attr-defined]
    config = config_from(parsed, {})
    assert config.metrics_port == ports["metrics"]
    assert parsed.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    assert config.peering_mode is PeeringMode.STANDALONE
    chosen = {} if values is None else yaml.safe_load(values.read_text())
    assert parsed.namespace == chosen.get("operator", {}).get("watchNamespaces", [])


def test_operator_options_reach_the_operator() -> None:
    container = _container("Deployment", "-operator", sets=ALL_OPTIONS)
    parsed = parse_args(container["args"])  # type: ignore[arg-type]
    assert parsed.namespace == ["serving", "batch"]
    config = config_from(parsed, {})
    assert config.orphan_dry_run is True
    assert config.orphan_grace_seconds == 600


def test_log_levels_reach_both_programs() -> None:
    sets = ("agent.logLevel=debug", "operator.logLevel=warning")
    agent = _container("DaemonSet", "-agent", sets=sets)
    operator = _container("Deployment", "-operator", sets=sets)
    agent_args = [a.replace("$(NODE_NAME)", "n") for a in agent["args"]]  # type: ignore[attr-defined]
    assert parse_config(agent_args, environ={}).log_level == "debug"
    assert parse_args(operator["args"]).log_level == "warning"  # type: ignore[arg-type]
