"""Cluster mode's region source: OffloadRegions (watched), this node's labels (read every
resync; the agent may only `get` Nodes) and the reclaims in its OffloadNode's spec (watched)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvshm.agent.cluster import rest
from kvshm.agent.cluster.watcher import ListWatch
from kvshm.agent.view import ClusterView, KnownRegion
from kvshm.api import (
    GROUP,
    NODE_PLURAL,
    REGION_PLURAL,
    VERSION,
    NodeName,
    ReclaimRequest,
    SpecError,
    parse_node_reports,
    parse_offload_region,
)
from kvshm.api.offload_node import parse_reclaim_requests, parse_retained

log = logging.getLogger(__name__)


def parse_reclaims(node: Mapping[str, Any] | None) -> tuple[ReclaimRequest, ...]:
    """spec.reclaims of this node's OffloadNode (a request written again with a new
    requestedAt has a new token, and is executed again)."""
    spec = (node or {}).get("spec")
    return parse_reclaim_requests(spec if isinstance(spec, Mapping) else None)


class ClusterSource:
    def __init__(
        self,
        api_client: Callable[[], client.ApiClient],
        node_name: NodeName,
        *,
        on_watch_restart: Callable[[], None],
        labels_refresh_seconds: float = 30.0,
    ) -> None:
        self.node_name = node_name
        self._api_client = api_client()
        self._labels_refresh = labels_refresh_seconds
        self._labels: dict[str, str] = {}
        self._labels_read_at: float | None = None
        self._labels_problem = ""
        self._on_watch_restart = on_watch_restart
        self._make_client = api_client
        self._regions: ListWatch | None = None
        self._nodes: ListWatch | None = None

    def start(self, wake: Callable[[], None]) -> None:
        self._regions = self._list_watch("offloadregions", wake, plural=REGION_PLURAL)
        self._nodes = self._list_watch(
            "offloadnode",
            wake,
            plural=NODE_PLURAL,
            field_selector=f"metadata.name={self.node_name}",
        )

    def _list_watch(self, what: str, wake: Callable[[], None], **kwargs: str) -> ListWatch:
        # an ApiClient per watch thread: a stream holds its connection for minutes
        api = client.CustomObjectsApi(self._make_client())
        watcher = ListWatch(
            what,
            api.list_cluster_custom_object,
            {"group": GROUP, "version": VERSION, **kwargs},
            on_change=wake,
            on_restart=self._on_watch_restart,
        )
        watcher.start()
        return watcher

    def synced(self) -> bool:
        """Both watches listed, and the Node's labels read once: without them nodeSelector
        regions would look unplaced, and be drained."""
        if self._labels_read_at is None or self._labels_problem:
            self._labels_read_at = None
            self._refresh_labels()
        labels_known = self._labels_read_at is not None and not self._labels_problem
        watches = all(w is not None and w.synced for w in (self._regions, self._nodes))
        return labels_known and watches

    def view(self) -> ClusterView:
        assert self._regions is not None and self._nodes is not None, "start() first"
        regions: dict[str, KnownRegion] = {}
        invalid: dict[str, str] = {}
        for key, obj in self._regions.items().items():
            try:
                region = parse_offload_region(obj)
            except SpecError as exc:
                invalid[key] = str(exc)
                continue
            except Exception as exc:  # one object must never stop every pass
                invalid[key] = f"could not be parsed ({type(exc).__name__}: {exc})"
                log.warning("OffloadRegion %s could not be parsed", key, exc_info=True)
                continue
            deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
            reported = parse_node_reports(obj.get("status")).get(self.node_name)
            holding = reported is not None and reported.holds_files
            regions[region.key] = KnownRegion(region, deleting, holding)
        problems = [w.last_error for w in (self._regions, self._nodes) if w.last_error]
        self._refresh_labels()
        if self._labels_problem:
            problems.append(self._labels_problem)
        return ClusterView(
            self.node_name,
            dict(self._labels),
            regions,
            invalid,
            parse_reclaims(self._nodes.items().get(self.node_name)),
            tuple(problems),
            self.listed_first(),
        )

    def listed_first(self) -> frozenset[str]:
        """Paths in this node's OffloadNode spec (retained files, requested reclaims): the
        operator forgets a retained file, or withdraws a reclaim, by whether it is listed, so
        a bounded inventory lists these first. Empty until the watch has listed."""
        node = self._nodes.items().get(self.node_name) if self._nodes is not None else None
        spec = (node or {}).get("spec")
        spec = spec if isinstance(spec, Mapping) else None
        retained = {entry.path for entry in parse_retained(spec)}
        return frozenset(retained | {request.path for request in parse_reclaim_requests(spec)})

    def close(self) -> None:
        for each in (self._regions, self._nodes):
            if each is not None:
                each.stop()

    def _refresh_labels(self) -> None:
        now = time.monotonic()
        if self._labels_read_at is not None and now - self._labels_read_at < self._labels_refresh:
            return
        self._labels_read_at = now
        try:
            node = rest.request(self._api_client, "GET", f"/api/v1/nodes/{self.node_name}")
        except ApiException as exc:
            # keep the last labels: a transient error must not move regions off this node
            self._labels_problem = (
                f"cannot read Node {self.node_name} ({exc.status} {exc.reason}); nodeSelector "
                f"placement uses the last labels read"
            )
            log.warning("%s", self._labels_problem)
            return
        self._labels = dict((node.get("metadata") or {}).get("labels") or {})
        self._labels_problem = ""
