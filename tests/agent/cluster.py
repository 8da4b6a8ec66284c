"""Cluster-mode test helpers: agents built exactly as `kvshm-agent` builds them, run in threads
(or as processes) against the real API server (tests/envtest) with the chart's agent
ServiceAccount token; the test body looks on as the admin."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes

from kvshm.agent.app import AgentApp, build_app
from kvshm.agent.cli import parse_config
from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.agent.builders import stop_agent
from tests.operator.harness import Cluster

REPO = Path(__file__).resolve().parents[2]


def agent_argv(kubeconfig: Path, node: str, root: Path, *extra: str) -> list[str]:
    return [
        "--node-name",
        node,
        "--kubeconfig",
        str(kubeconfig),
        "--root",
        str(root),
        "--resync-seconds",
        "1",
        "--drain-grace-seconds",
        "5",
        "--no-http",
        *extra,
    ]


@contextlib.contextmanager
def running_agent(kubeconfig: Path, node: str, root: Path, *extra: str) -> Iterator[AgentApp]:
    """An in-process agent in a thread; stopped (releasing nothing on disk) on exit."""
    app = build_app(parse_config(agent_argv(kubeconfig, node, root, *extra)))
    stop = threading.Event()
    thread = threading.Thread(target=app.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield app
    finally:
        stop.set()
        app.loop.wakeup()
        thread.join(30)
        stop_agent(app.reconciler)
        app.root.close()


def agent_process(kubeconfig: Path, node: str, root: Path, *extra: str) -> subprocess.Popen[str]:
    """`python -m kvshm.agent.cli` in cluster mode, as the DaemonSet runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvshm.agent.cli", *agent_argv(kubeconfig, node, root, *extra)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
    )


class AgentCluster(Cluster):
    """The admin's view for the agent's tests: whole manifests, one node's status entry,
    the writes an operator or another agent would make, and Events as the server keeps them."""

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        body = {**manifest, "metadata": dict(manifest["metadata"])}
        body["metadata"].pop("uid", None)  # the server gives it
        namespace = body["metadata"].setdefault("namespace", self.namespace)
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, REGION_PLURAL, body
        )
        return created

    def node_status(self, name: str, node: str, namespace: str | None = None) -> dict[str, Any]:
        region = self._get(name, namespace or self.namespace) or {}
        nodes: dict[str, dict[str, Any]] = (region.get("status") or {}).get("nodes") or {}
        return nodes.get(node) or {}

    def phase_on(self, name: str, node: str, namespace: str | None = None) -> str:
        return str(self.node_status(name, node, namespace).get("phase", ""))

    def _get(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, namespace, REGION_PLURAL, name
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    def patch_region(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, REGION_PLURAL, name, patch
        )

    def patch_region_status(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, REGION_PLURAL, name, patch
        )

    def patch_offload_node_spec(self, node: str, spec: dict[str, Any]) -> None:
        self.custom.patch_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, node, {"spec": spec})

    def delete_offload_node(self, node: str) -> None:
        self.custom.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, node)

    def node_status_of(self, node: str) -> dict[str, Any]:
        """The OffloadNode's status ({} while there is none)."""
        return (self.offload_node(node) or {}).get("status") or {}

    def all_events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Core v1 Events of a namespace as the server serialises them (camelCase keys)."""
        listed = self.core.list_namespaced_event(namespace or self.namespace)
        items: list[dict[str, Any]] = self.client.sanitize_for_serialization(listed)["items"]
        return items

    def clear_events(self, namespace: str) -> None:
        """Forget Events of earlier tests (cluster-scoped objects' Events land in `default`)."""
        self.core.delete_collection_namespaced_event(namespace)

    def status_history(
        self,
        region: dict[str, Any],
        until: Callable[[dict[str, Any]], bool],
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Every status the region has had since `region` (as created or read: a watch from
        its resourceVersion, so no write is missed), up to the first for which until() holds."""
        metadata = region["metadata"]
        seen: list[dict[str, Any]] = []
        watch = kubernetes.watch.Watch()
        for event in watch.stream(
            self.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            metadata["namespace"],
            REGION_PLURAL,
            field_selector=f"metadata.name={metadata['name']}",
            resource_version=metadata["resourceVersion"],
            timeout_seconds=int(timeout),
        ):
            seen.append(event["object"].get("status") or {})
            if until(seen[-1]):
                watch.stop()
                return seen
        raise AssertionError(f"{metadata['name']} not there in {timeout}s; statuses: {seen}")
