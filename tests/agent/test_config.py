"""kvshm-agent's config: built once from the command line and the environment, typed, frozen,
and refused with the flag named (exit 2 with the usage) before anything starts."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from kvshm.agent.cli import parse_config
from kvshm.agent.config import AgentConfig, AgentConfigError

CLUSTER = ["--node-name", "gpu-1"]


def test_defaults_in_cluster_mode() -> None:
    config = parse_config(CLUSTER, environ={})
    assert config == AgentConfig(node_name="gpu-1")
    assert config.local is None and config.serve_http and config.http_host == "0.0.0.0"
    assert (config.root, config.port, config.resync_seconds) == ("/dev/shm/kvshm", 9464, 30.0)


def test_node_name_from_the_flag_then_node_name_variable_then_host_name() -> None:
    assert parse_config(CLUSTER, environ={"NODE_NAME": "other"}).node_name == "gpu-1"
    assert parse_config([], environ={"NODE_NAME": "from-env"}).node_name == "from-env"
    assert parse_config([], environ={}).node_name == socket.gethostname()


def test_local_mode_serves_only_this_machine_and_keeps_its_labels() -> None:
    argv = ["--local", "regions", "--node-label", "zone=a", "--node-label", "gpu=h100"]
    config = parse_config(argv, environ={"NODE_NAME": "n"})
    assert config.local == "regions" and config.http_host == "127.0.0.1"
    assert dict(config.node_labels) == {"zone": "a", "gpu": "h100"}
    assert parse_config([*argv, "--bind", "0.0.0.0"], environ={}).http_host == "0.0.0.0"
    assert parse_config([*argv, "--no-http"], environ={}).serve_http is False


def test_every_flag_reaches_its_field() -> None:
    argv = [
        *CLUSTER,
        "--kubeconfig", "/k", "--root", "/r", "--reserve-bytes", "2Gi",
        "--drain-grace-seconds", "5", "--populate-threads", "3", "--populate-rate", "1Gi",
        "--parallel-regions", "2", "--proc-scan", "--resync-seconds", "4", "--poll-seconds", "0.5",
        "--port", "0", "--once", "--log-level", "debug",
    ]  # fmt: skip
    assert parse_config(argv, environ={}) == AgentConfig(
        node_name="gpu-1",
        kubeconfig="/k",
        root="/r",
        reserve_bytes=2 * 2**30,
        drain_grace_seconds=5.0,
        populate_threads=3,
        populate_bytes_per_second=2**30,
        parallel_regions=2,
        proc_scan=True,
        resync_seconds=4.0,
        poll_seconds=0.5,
        port=0,
        once=True,
        log_level="debug",
    )


def test_the_config_cannot_change_once_built() -> None:
    labels = {"zone": "a"}
    config = AgentConfig(node_name="n", local="regions", node_labels=labels)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.node_labels["zone"] = "b"  # type: ignore[index]
    labels["zone"] = "b"  # the caller's dict is copied, not kept
    assert config.node_labels["zone"] == "a"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel-regions", "0"], "--parallel-regions must be at least 1, got 0"),
        (["--populate-threads", "0"], "--populate-threads must be at least 1, got 0"),
        (["--populate-rate", "0"], "--populate-rate must be greater than 0, got 0"),
        (["--resync-seconds", "0"], "--resync-seconds must be greater than 0"),
        (["--poll-seconds", "-1"], "--poll-seconds must be greater than 0"),
        (["--drain-grace-seconds", "-1"], "--drain-grace-seconds must be at least 0"),
        (["--port", "70000"], "--port must be 0 to 65535, got 70000"),
        (["--root", ""], "--root must not be empty"),
        (["--local", "d", "--kubeconfig", "k"], "--kubeconfig is for cluster mode"),
        (["--node-label", "zone=a"], "--node-label is for local mode"),
    ],
)
def test_a_value_the_agent_cannot_run_with_exits_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config([*CLUSTER, *argv], environ={})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvshm-agent") and message in err


def test_an_empty_node_name_everywhere_is_refused() -> None:
    with pytest.raises(AgentConfigError, match="--node-name must not be empty"):
        AgentConfig(node_name="")
