"""Cluster-mode test helpers: agents built exactly as `kvshm-agent` builds them, run in threads
(or as processes) against the Kubernetes API emulator."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvshm.agent.app import AgentApp, build_app
from kvshm.agent.cli import build_parser
from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.kube.runner import KubeApi

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
    app = build_app(build_parser().parse_args(agent_argv(kubeconfig, node, root, *extra)))
    stop = threading.Event()
    thread = threading.Thread(target=app.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield app
    finally:
        stop.set()
        app.loop.wakeup()
        thread.join(30)
        app.reconciler.wait_idle(30)
        for hosted in app.reconciler.hosted_regions().values():
            hosted.release()  # what process exit does; the files stay
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


def setup_cluster(api: KubeApi, *namespaces: str, nodes: dict[str, dict[str, str]]) -> None:
    for namespace in namespaces:
        api.create("", "v1", "namespaces", {"metadata": {"name": namespace}})
    for node, labels in nodes.items():
        api.create("", "v1", "nodes", {"metadata": {"name": node, "labels": labels}})


def create_region(api: KubeApi, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {**manifest, "metadata": dict(manifest["metadata"])}
    manifest["metadata"].pop("uid", None)
    namespace = manifest["metadata"]["namespace"]
    return api.create(GROUP, VERSION, REGION_PLURAL, manifest, namespace)


def get_region(api: KubeApi, namespace: str, name: str) -> dict[str, Any]:
    return api.get(GROUP, VERSION, REGION_PLURAL, name, namespace)


def node_status(api: KubeApi, region: dict[str, Any], node: str) -> dict[str, Any]:
    metadata = region["metadata"]
    current = get_region(api, metadata["namespace"], metadata["name"])
    nodes: dict[str, dict[str, Any]] = (current.get("status") or {}).get("nodes") or {}
    return nodes.get(node) or {}


def phase_of(api: KubeApi, region: dict[str, Any], node: str) -> str:
    return str(node_status(api, region, node).get("phase", ""))


def offload_node(api: KubeApi, node: str) -> dict[str, Any]:
    return api.get(GROUP, VERSION, NODE_PLURAL, node)


def region_patches(api: KubeApi, name: str) -> list[dict[str, Any]]:
    """Bodies of the status patches sent to one region, in order."""
    return [
        r.data
        for r in api.requests
        if r.method == "PATCH"
        and r.subresource == "status"
        and r.name == name
        and "offloadregions" in str(r.url)
    ]


def patch_region(api: KubeApi, namespace: str, name: str, patch: dict[str, Any]) -> None:
    api.call(
        lambda s: s.patch(
            s.resource(GROUP, VERSION, REGION_PLURAL),
            namespace,
            name,
            "application/merge-patch+json",
            patch,
            None,
        )
    )


def delete_region(api: KubeApi, namespace: str, name: str) -> None:
    api.call(lambda s: s.delete(s.resource(GROUP, VERSION, REGION_PLURAL), namespace, name))


def patch_offload_node_spec(api: KubeApi, node: str, spec: dict[str, Any]) -> None:
    api.call(
        lambda s: s.patch(
            s.resource(GROUP, VERSION, NODE_PLURAL),
            None,
            node,
            "application/merge-patch+json",
            {"spec": spec},
            None,
        )
    )


def events(api: KubeApi, namespace: str) -> list[dict[str, Any]]:
    return api.call(
        lambda s: s.list_objects(s.resource("", "v1", "events"), namespace, lambda _: True)
    )
