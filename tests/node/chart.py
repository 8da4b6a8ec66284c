"""The chart on the node, driven as a platform engineer drives it: helm and kubectl as the
cluster's admin, values a user could set, and waits on what `kubectl get` shows."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml

from tests.envtest.server import REPO
from tests.node.node import Node, NodeError

CHART = REPO / "charts" / "kvshm"
NAMESPACE = "kvshm-system"
T = TypeVar("T")


def wait(probe: Callable[[], T | None], timeout: float, what: str, node: Node) -> T:
    """The first truthy probe() within timeout; else an error with what was awaited, what the
    cluster's pods and events say, and the node's logs."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (kubernetes.client.ApiException, NodeError) as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        time.sleep(0.5)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}; last: {last!r}\n"
        f"{describe_cluster(node)}\n{node.logs_tail(('kubelet', 'containerd'), 2000)}"
    )


def describe_cluster(node: Node) -> str:
    parts = []
    for args in (
        ("get", "pods", "-A", "-o", "wide"),
        ("get", "events", "-A", "--sort-by=.lastTimestamp"),
    ):
        try:
            parts.append(node.kubectl(*args)[-4000:])
        except NodeError as exc:
            parts.append(str(exc))
    return "\n".join(parts)


@dataclass
class Release:
    """A helm release of charts/kvshm on the node."""

    node: Node
    home: Path
    name: str = "kvshm"
    namespace: str = NAMESPACE

    @staticmethod
    def default_image() -> str:
        """The image the chart runs with no image values: values.yaml's repository and the
        chart's appVersion."""
        values = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
        app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        return f"{values['repository']}:{values['tag'] or app_version}"

    def helm(self, *args: str, timeout: float = 300) -> str:
        env = dict(
            os.environ,
            KUBECONFIG=str(self.node.admin_kubeconfig),
            HELM_CACHE_HOME=str(self.home / "cache"),
            HELM_CONFIG_HOME=str(self.home / "config"),
            HELM_DATA_HOME=str(self.home / "data"),
        )
        done = subprocess.run(
            [str(REPO / ".tools" / "bin" / "helm"), *args],
            capture_output=True, text=True, env=env, timeout=timeout, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise NodeError(
                f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}"
                f"{done.stderr}\n{describe_cluster(self.node)}"
            )
        return done.stdout

    def install(self, *values: str, chart: Path = CHART) -> str:
        return self.helm(
            "install", self.name, str(chart), "-n", self.namespace, "--create-namespace",
            *values,
        )  # fmt: skip

    def uninstall(self, timeout: float = 120) -> None:
        """helm uninstall, then wait until the release's pods are gone too (helm waits for the
        objects it deletes, not for the pods their controllers' deletion leaves to collect)."""
        self.helm("uninstall", self.name, "-n", self.namespace, "--wait", "--ignore-not-found")
        wait(
            lambda: not [p for p in self.pods() if component(p) in ("agent", "operator")],
            timeout, f"{self.name}'s agent and operator pods gone", self.node,
        )  # fmt: skip

    def pods(self) -> list[dict[str, Any]]:
        listed = json.loads(
            self.node.kubectl(
                "get", "pods", "-n", self.namespace, "-o", "json",
                "-l", f"app.kubernetes.io/instance={self.name}",
            )
        )  # fmt: skip
        pods: list[dict[str, Any]] = listed["items"]
        return pods

    def wait_ready(
        self, components: tuple[str, ...] = ("agent", "operator"), timeout: float = 180
    ) -> list[dict[str, Any]]:
        """Every pod of these components Running and Ready (their probes passed)."""

        def ready() -> list[dict[str, Any]] | None:
            pods = [
                p
                for p in self.pods()
                if component(p) in components
                and not p["metadata"].get("deletionTimestamp")
                # pods that ended (evicted ones stay, Failed) are not the release's current ones
                and p["status"].get("phase") not in ("Failed", "Succeeded")
            ]
            found = {component(p) for p in pods}
            if found != set(components) or not all(pod_ready(p) for p in pods):
                return None
            return pods

        return wait(ready, timeout, f"{self.name}'s {', '.join(components)} pods Ready", self.node)


def component(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or ()}
    return status.get("phase") == "Running" and conditions.get("Ready") == "True"


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or ())
