"""Connecting cluster mode: API configuration, this node's OffloadNode, source and sink."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from kubernetes import client, config

from kvshm.agent.cluster.sink import ClusterSink
from kvshm.agent.cluster.source import ClusterSource
from kvshm.agent.metrics import AgentMetrics
from kvshm.api import NodeInventory, NodeName


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """--kubeconfig, else the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(client_configuration=configuration)
    return configuration


def orphaned_since(status: Mapping[str, Any]) -> dict[str, datetime]:
    """orphanedSince of the last published inventory, to carry over a restart."""
    files = NodeInventory.from_status(status).files
    return {f.path: f.orphaned_since for f in files if f.orphaned_since is not None}


def connect_cluster(
    node_name: str,
    kubeconfig: str | None,
    metrics: AgentMetrics,
    version: str,
    *,
    resync_seconds: float = 30.0,
) -> tuple[ClusterSource, ClusterSink, dict[str, datetime]]:
    node = NodeName(node_name)  # checked before anything is asked of the API server
    configuration = load_configuration(kubeconfig)
    make_client: Callable[[], client.ApiClient] = lambda: client.ApiClient(configuration)  # noqa: E731
    sink = ClusterSink(
        make_client(),
        node,
        version,
        count_error=metrics.error,
        heartbeat_seconds=resync_seconds,
        on_published=lambda published: metrics.inventory_omitted(published.omitted_count),
    )
    previous = sink.ensure_node()
    source = ClusterSource(
        make_client,
        node,
        on_watch_restart=metrics.watch_restarted,
        labels_refresh_seconds=resync_seconds,
    )
    return source, sink, orphaned_since(previous)
