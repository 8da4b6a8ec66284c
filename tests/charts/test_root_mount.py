"""regionRootMount: the privileged init container that puts the region root on a huge-page
tmpfs (kvshm-agent mount-root), rendered only when asked for, its command line parsed by the
program itself, its objects valid and admitted by a real API server; agent.hugePages reaching
the agent."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from kvshm.agent.cli import parse_config
from kvshm.agent.root.mountroot import build_parser
from kvshm.agent.root.rootpages import HugePagesMode
from tests.charts.rendering import EXAMPLE_VALUES, find, render
from tests.charts.test_kubernetes_schemas import validate_builtin
from tests.charts.tools import CHART, run, tool

ENABLED = ("regionRootMount.enabled=true",)


def agent_pod(sets: tuple[str, ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = find(render(sets=sets), "DaemonSet", "-agent")["spec"]["template"][
        "spec"
    ]
    return spec


@pytest.mark.parametrize("values", EXAMPLE_VALUES)
def test_no_example_mounts_anything_nor_runs_a_privileged_container(values: object) -> None:
    spec = find(render(values), "DaemonSet", "-agent")["spec"]["template"]["spec"]  # type: ignore[arg-type]
    assert "initContainers" not in spec


def test_the_init_container_mounts_the_root_with_bidirectional_propagation() -> None:
    sets = (*ENABLED, "regionRoot=/mnt/kvshm", "regionRootMount.size=256g")
    spec = agent_pod(sets)
    [init] = spec["initContainers"]
    assert init["command"] == ["kvshm-agent"] and init["args"][0] == "mount-root"
    parsed = build_parser().parse_args(init["args"][1:])
    assert (parsed.root, parsed.size, parsed.huge) == ("/mnt/kvshm", "256g", "within_size")
    context = init["securityContext"]
    # Bidirectional propagation is for privileged containers only (the API server says so)
    assert context["privileged"] is True and context["runAsUser"] == 0
    [mount] = init["volumeMounts"]
    assert mount == {
        "name": "region-root",
        "mountPath": "/mnt/kvshm",
        "mountPropagation": "Bidirectional",
    }
    # the same hostPath the agent and the serving pods use; the agent itself stays locked down
    volume = next(v for v in spec["volumes"] if v["name"] == "region-root")
    assert volume["hostPath"]["path"] == "/mnt/kvshm"
    agent = spec["containers"][0]
    assert agent["securityContext"]["privileged"] is False
    assert "mountPropagation" not in next(
        m for m in agent["volumeMounts"] if m["name"] == "region-root"
    )


def test_the_rendered_objects_stay_valid_with_the_mount() -> None:
    objects = render(sets=ENABLED)
    errors = [error for o in objects if o["apiVersion"] != "monitoring.coreos.com/v1"
              if (error := validate_builtin(o)) is not None]  # fmt: skip
    assert errors == []


def test_the_api_server_admits_the_daemonset_with_the_privileged_init_container(
    envtest_admin: kubernetes.client.ApiClient, envtest_namespace: str
) -> None:
    daemonset = find(render(sets=ENABLED), "DaemonSet", "-agent")
    daemonset["metadata"]["namespace"] = envtest_namespace
    created = kubernetes.client.AppsV1Api(envtest_admin).create_namespaced_daemon_set(
        envtest_namespace, daemonset, dry_run="All"
    )
    init = created.spec.template.spec.init_containers[0]
    assert init.volume_mounts[0].mount_propagation == "Bidirectional"


@pytest.mark.parametrize("mode", ["warn", "require", "ignore"])
def test_agent_huge_pages_reaches_the_agent(mode: str) -> None:
    agent = agent_pod((f"agent.hugePages={mode}",))["containers"][0]
    args = [a.replace("$(NODE_NAME)", "gpu-1") for a in agent["args"]]
    assert parse_config(args, environ={}).huge_pages is HugePagesMode(mode)


def test_the_default_is_to_warn() -> None:
    args = [a.replace("$(NODE_NAME)", "gpu-1") for a in agent_pod()["containers"][0]["args"]]
    assert parse_config(args, environ={}).huge_pages is HugePagesMode.WARN


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [
        ("regionRootMount.size=256Gi", "regionRootMount.size"),  # a quantity, not tmpfs's size=
        ("regionRootMount.size=0", "regionRootMount.size"),
        ("regionRootMount.size=150%", "regionRootMount.size"),
        ("regionRootMount.huge=advise", "regionRootMount.huge"),
        ("agent.hugePages=yes", "agent.hugePages"),
    ],
)
def test_values_the_mount_cannot_use_are_refused(bad: str, complaint: str) -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", bad)
    assert result.returncode != 0, f"--set {bad} was accepted"
    assert complaint in result.stderr, result.stderr


@pytest.mark.parametrize("good", ["regionRootMount.size=512g", "regionRootMount.size=75%"])
def test_tmpfs_sizes_are_accepted(good: str) -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", good)
    assert result.returncode == 0, result.stderr
