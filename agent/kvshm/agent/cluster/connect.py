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


def unclaimed_since(status: Mapping[str, Any]) -> dict[str, datetime]:
    """firstSeenUnclaimed of the last published inventory, to carry over a restart."""
    files = status.get("files")
    since = {}
    for entry in files if isinstance(files, list) else []:
        stamp = entry.get("firstSeenUnclaimed") if isinstance(entry, Mapping) else None
        if not isinstance(stamp, str):
            continue
        try:
            since[str(entry.get("path"))] = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            continue
    return since


def connect_cluster(
    node_name: str,
    kubeconfig: str | None,
    metrics: AgentMetrics,
    version: str,
    *,
    resync_seconds: float = 30.0,
) -> tuple[ClusterSource, ClusterSink, dict[str, datetime]]:
    configuration = load_configuration(kubeconfig)
    make_client: Callable[[], client.ApiClient] = lambda: client.ApiClient(configuration)  # noqa: E731
    sink = ClusterSink(
        make_client(),
        node_name,
        version,
        count_error=metrics.error,
        heartbeat_seconds=resync_seconds,
    )
    previous = sink.ensure_node()
    source = ClusterSource(
        make_client,
        node_name,
        on_watch_restart=metrics.watch_restarted,
        labels_refresh_seconds=resync_seconds,
    )
    return source, sink, unclaimed_since(previous)
