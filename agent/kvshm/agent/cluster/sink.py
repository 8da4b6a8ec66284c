"""Cluster mode's status sink: region reports, the OffloadNode and Events, through the API.

Each agent writes only its own key of a region's status, `status.nodes.<node>`, with a JSON
merge patch of exactly that key and no resourceVersion: the API server applies it to the latest
object, so N agents reporting at once never overwrite each other. The OffloadNode (one per node,
named after it) has this agent as its only status writer.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvshm.agent.cluster import rest
from kvshm.agent.errors import ErrorReason
from kvshm.agent.gate import ReportGate
from kvshm.agent.inventory import (
    MAX_PUBLISHED_BYTES,
    MAX_PUBLISHED_FILES,
    PublishedFiles,
    published_files,
)
from kvshm.agent.reports import AgentEvent, PassResult
from kvshm.agent.root.rootpages import describe_pages, is_huge, missing_huge_pages
from kvshm.api import (
    GROUP,
    NODE_KIND,
    NODE_PLURAL,
    REGION_KIND,
    REGION_PLURAL,
    VERSION,
    NodeName,
    NodeReport,
    RootPages,
)
from kvshm.api.address import split_region_key
from kvshm.api.conditions import Condition, NodeConditionType, merge_conditions
from kvshm.api.messages import bounded, status_message, summarize
from kvshm.api.reading import format_timestamp
from kvshm.api.requests import REQUEST_TIMEOUT

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
EVENT_COMPONENT = "kvshm-agent"
NODE_EVENT_NAMESPACE = "default"  # Events about a cluster-scoped OffloadNode live here
_VOLATILE = ("heartbeat", "freeBytes")  # change every pass; sent at the heartbeat's pace


class ClusterSink:
    def __init__(
        self,
        api_client: client.ApiClient,
        node_name: NodeName,
        version: str,
        *,
        count_error: Callable[[ErrorReason], None],
        heartbeat_seconds: float = 30.0,
        progress_seconds: float = 1.0,
        on_published: Callable[[PublishedFiles], None] = lambda published: None,
    ) -> None:
        self.node_name = node_name
        self._version = version
        self._custom = client.CustomObjectsApi(api_client)
        self._api_client = api_client
        self._count_error = count_error
        self._heartbeat_seconds = heartbeat_seconds
        self._on_published = on_published
        self._gate = ReportGate(progress_seconds)
        self._transitions: dict[str, tuple[str, datetime]] = {}  # key -> (phase, since)
        self._node_status: dict[str, Any] | None = None
        self._node_status_at = 0.0

    # -- the OffloadNode -------------------------------------------------------------------

    def ensure_node(self) -> dict[str, Any]:
        """Create this node's OffloadNode if it is missing; return its current status."""
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": NODE_KIND,
            # named after the node, no label: a node name (up to 253 characters) is no label
            # value (at most 63), and the name alone selects it (fieldSelector metadata.name)
            "metadata": {"name": self.node_name},
            "spec": {},
        }
        try:
            self._custom.create_cluster_custom_object(
                GROUP, VERSION, NODE_PLURAL, body, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
        node: dict[str, Any] = self._custom.get_cluster_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, NODE_PLURAL, self.node_name, _request_timeout=REQUEST_TIMEOUT
        )
        status: dict[str, Any] = node.get("status") or {}
        return status

    def _publish_node(self, result: PassResult) -> None:
        if result.root_scan is None:
            return
        scan = result.root_scan
        published = published_files(scan.inventory.files, scan.looked_up)
        self._on_published(published)
        inventory = replace(
            scan.inventory,
            files=published.files,
            reclaims=tuple(r for _, r in sorted(result.reclaims.items())),
            agent_version=self._version,
        )
        status = inventory.to_status()
        wanted = [
            _root_condition(scan.problems),
            _inventory_condition(published, len(scan.inventory.files)),
        ]
        if scan.huge_pages_wanted and scan.inventory.pages is not None:
            wanted.append(_pages_condition(scan.root, scan.inventory.pages))
        last = self._node_status
        # a condition's transition time moves only when its status does (and before the
        # comparison: made afresh each pass, it would make every pass look like a change)
        status["conditions"] = merge_conditions(
            last.get("conditions") if last is not None else None,
            wanted,
            None,
            datetime.now(UTC),
            keep_unset=False,
        )
        steady = {k: v for k, v in status.items() if k not in _VOLATILE}
        steady["files"] = [
            {k: v for k, v in f.items() if k != "ageSeconds"} for f in status["files"]
        ]
        due = time.monotonic() - self._node_status_at >= self._heartbeat_seconds
        if last is not None and last == steady and not due:
            return
        status["heartbeat"] = format_timestamp(datetime.now(UTC))
        try:
            self._patch_node_status(status)
        except ApiException as exc:
            self._api_error(f"patching OffloadNode {self.node_name}", exc)
            if exc.status == 404:  # someone deleted it: make it again, report on the next pass
                self._node_status = None
                with contextlib.suppress(ApiException):
                    self.ensure_node()
                return
            if not self._publish_heartbeat_only(status, exc):
                return
        # after a heartbeat-only patch too: the whole status is tried again at the heartbeat's
        # pace, or as soon as something in it changes
        self._node_status, self._node_status_at = steady, time.monotonic()

    def _publish_heartbeat_only(self, status: dict[str, Any], refused: ApiException) -> bool:
        """The status without its lists, after the whole one was refused (too large, or one
        entry invalid): the heartbeat must never wait on the inventory, or the operator would
        take the agent for silent. The inventory last accepted stays (never an empty list: the
        operator would take every file for gone)."""
        why = f"{refused.status} {refused.reason}: {_api_message(refused)}"
        not_published = Condition(
            NodeConditionType.INVENTORY_COMPLETE,
            False,
            "NotPublished",
            f"the API server refused this node's status ({why}); only the heartbeat and "
            f"free bytes are published, the inventory stays as last accepted",
        )
        conditions = merge_conditions(
            status["conditions"], [not_published], None, datetime.now(UTC)
        )
        small = {k: v for k, v in status.items() if k not in ("files", "reclaims")}
        small["conditions"] = conditions
        try:
            self._patch_node_status(small)
        except ApiException as exc:
            self._api_error(f"patching OffloadNode {self.node_name} (heartbeat only)", exc)
            return False
        log.warning(
            "OffloadNode %s: inventory refused (%s); heartbeat sent alone", self.node_name, why
        )
        return True

    def _patch_node_status(self, status: dict[str, Any]) -> None:
        self._custom.patch_cluster_custom_object_status(
            GROUP,
            VERSION,
            NODE_PLURAL,
            self.node_name,
            {"status": status},
            _content_type=MERGE_PATCH,
            _request_timeout=REQUEST_TIMEOUT,
        )

    # -- regions ---------------------------------------------------------------------------

    def _publish_reports(self, reports: Mapping[str, NodeReport]) -> None:
        for key, report in sorted(self._gate.due(reports).items()):
            namespace, name = split_region_key(key)
            entry = replace(report, last_transition_time=self._transition_time(key, report))
            patch = {"status": {"nodes": {self.node_name: entry.to_status()}}}
            try:
                self._custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    REGION_PLURAL,
                    name,
                    patch,
                    _content_type=MERGE_PATCH,
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status == 404:  # the region is gone: nothing left to report to
                    self._gate.published(key, report)
                    continue
                self._api_error(f"patching OffloadRegion {key} status", exc)
                continue
            self._gate.published(key, report)

    def _transition_time(self, key: str, report: NodeReport) -> datetime:
        phase = report.phase_name
        last = self._transitions.get(key)
        if last is None or last[0] != phase:
            last = (phase, datetime.now(UTC))
            self._transitions[key] = last
        return last[1]

    # -- events ----------------------------------------------------------------------------

    def _publish_event(self, event: AgentEvent) -> None:
        now = format_timestamp(datetime.now(UTC))
        if event.region_key:
            namespace, name = split_region_key(event.region_key)
            involved = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": REGION_KIND,
                "namespace": namespace,
                "name": name,
                "uid": event.region_uid,
            }
        else:
            namespace, name = NODE_EVENT_NAMESPACE, self.node_name
            involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": NODE_KIND, "name": name}
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": involved,
            "reason": event.reason.value,
            "message": event.message[:1024],
            "type": "Warning" if event.warning else "Normal",
            "source": {"component": EVENT_COMPONENT, "host": self.node_name},
            "reportingComponent": f"{GROUP}/agent",
            "reportingInstance": self.node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            rest.request(self._api_client, "POST", f"/api/v1/namespaces/{namespace}/events", body)
        except ApiException as exc:
            self._api_error(f"creating Event {event.reason.value} for {name}", exc)

    # -- StatusSink ------------------------------------------------------------------------

    def publish(self, result: PassResult) -> None:
        for event in result.events:
            self._publish_event(event)
        self._publish_reports(result.reports)
        self._publish_node(result)

    def close(self) -> None:
        pass  # nothing to release: stopping the agent leaves every report as it was

    def _api_error(self, what: str, exc: ApiException) -> None:
        self._count_error(ErrorReason.API)
        log.warning("%s failed: %s %s; retried on the next pass", what, exc.status, exc.reason)


def _root_condition(problems: tuple[str, ...]) -> Condition:
    if not problems:
        return Condition(
            NodeConditionType.ROOT_SAFE, True, "NoUnsafeEntries", "nothing unsafe found"
        )
    return Condition(NodeConditionType.ROOT_SAFE, False, "UnsafeEntries", "; ".join(problems))


def _inventory_condition(published: PublishedFiles, found: int) -> Condition:
    if not published.omitted:
        return Condition(
            NodeConditionType.INVENTORY_COMPLETE, True, "AllListed", f"all {found} entries listed"
        )
    by_count = sorted(published.omitted.items(), key=lambda item: (-item[1], item[0]))
    where = summarize([f"{count} in {namespace}" for namespace, count in by_count], "namespaces")
    return Condition(
        NodeConditionType.INVENTORY_COMPLETE,
        False,
        "Capped",
        f"{published.omitted_count} of {found} entries not listed ({where}): the OffloadNode "
        f"lists at most {MAX_PUBLISHED_FILES} entries and {MAX_PUBLISHED_BYTES} bytes of them "
        f"(docs/agent.md), and the operator neither reclaims nor counts a file it is not shown. "
        f"Remove the files that are no region's from those namespaces' directories",
    )


def _pages_condition(root: str, pages: RootPages) -> Condition:
    if is_huge(pages):
        return Condition(
            NodeConditionType.HUGE_PAGES,
            True,
            "HugePages",
            f"region files get {describe_pages(pages)}",
        )
    return Condition(
        NodeConditionType.HUGE_PAGES, False, "SmallPages", missing_huge_pages(root, pages)
    )


def _api_message(exc: ApiException) -> str:
    """The Status message of an API error's body, else its body, briefly."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body)
    return bounded(status_message(body) or body, 512)
