"""kopf handlers: thin and typed. Each reads what kopf hands it, calls a plain decision function
(orphans, nodes) or hands the region to the book (kvshm.operator.book, which decides with
regions.plan_region) and applies the result as writes, Events and metrics. Nothing here decides
anything on its own, so every rule is unit-tested without kopf.

The decorators are applied in kvshm.operator.wiring.register, with the configured intervals.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from kvshm.api import (
    NODE_PLURAL,
    InvalidAddressError,
    OffloadNode,
    RegionAddress,
    parse_offload_node,
)
from kvshm.api.events import EventReason
from kvshm.api.reading import MAX_RECLAIMS
from kvshm.operator import metrics
from kvshm.operator.announcements import Announcement
from kvshm.operator.announcements import post as post_event
from kvshm.operator.book import RegionBook
from kvshm.operator.cluster import ClusterSnapshot, Snapshots, first_values
from kvshm.operator.config import OperatorConfig
from kvshm.operator.finalizers import remove_ops
from kvshm.operator.kopf_settings import FINALIZER, configure
from kvshm.operator.kube import KubernetesClientWriter
from kvshm.operator.memo import OperatorMemo, operator_config, orphan_clock
from kvshm.operator.nodes import forget_retained, reclaims_after, removal_reason
from kvshm.operator.orphans import OrphanDecision, announcements, decide_reclaims

# how old the cluster a decision reads may be: hundreds of sweeps a second at thousands of
# nodes each copied every region's path (most of the operator's CPU at 5,000 regions)
SNAPSHOT_SECONDS = 1.0


def _now() -> datetime:
    return datetime.now(UTC)


# --- start-up --------------------------------------------------------------------------------


async def startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **indexes: Any) -> None:
    """Settings for kvshm; the config comes from main() through the memo, else from the env."""
    config = operator_config(memo)
    configure(settings, config)
    if memo.get("writer") is None:
        memo.writer = KubernetesClientWriter()
    # kopf's indexes are live views, copied at most once a SNAPSHOT_SECONDS for every decision
    memo.views = Snapshots(lambda: _cluster(config, indexes), SNAPSHOT_SECONDS)
    memo.book = RegionBook(config, memo.writer, memo.views.get, FINALIZER)
    metrics.serve_once(config.metrics_port)


async def cleanup(memo: OperatorMemo, **_: Any) -> None:
    """Stop the book's task with the operator (in a test's loop, it would outlive it)."""
    book = memo.get("book")
    if isinstance(book, RegionBook):
        await book.stop()


async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """$KUBECONFIG when set (read now, not at the client library's import), else in-cluster."""
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


async def probe_regions(**_: Any) -> int:
    """Liveness detail: how many regions this replica tracks (the endpoint itself is the probe)."""
    return len(metrics.TOTALS.region_phases)


# --- indexes: the cluster as the decisions see it --------------------------------------------


async def node_labels(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, dict[str, str]]:
    return {name: dict(labels)}


async def agents(body: kopf.Body, **_: Any) -> dict[str, OffloadNode]:
    node = parse_offload_node(body)
    return {} if node is None else {node.name: node}


async def region_paths(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[str, str]:
    """Region key -> its file 0's path: every path here is claimed, whatever an agent says.
    (Indexed twice: all regions, and live ones, those not being deleted.)"""
    try:
        address = RegionAddress(namespace or "default", name, str(spec.get("instanceId") or name))
    except InvalidAddressError:
        return {}  # an invalid instance id names no file
    return {address.key: address.file_0_path}


def _cluster(config: OperatorConfig, indexes: Mapping[str, Any]) -> ClusterSnapshot:
    node_labels: kopf.Index[str, dict[str, str]] = indexes["node_labels"]
    agents: kopf.Index[str, OffloadNode] = indexes["agents"]
    region_paths: kopf.Index[str, str] = indexes["region_paths"]
    live_region_paths: kopf.Index[str, str] = indexes["live_region_paths"]
    return ClusterSnapshot(
        nodes=first_values(node_labels),
        agents=first_values(agents),
        now=_now(),
        silence_seconds=config.agent_silence_seconds,
        regions=first_values(region_paths),
        live_regions=first_values(live_region_paths),
    )


# --- OffloadRegion: the book decides and writes ---------------------------------------------


async def region_changed(type: str, body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
    """Every change (a create, an agent's report, a spec edit, a deletion) is decided again at
    once, by the book's task: this handler never waits for the API server."""
    book = memo.book
    key = book.observe(body)
    if type == "DELETED":
        book.forget(key)
    else:
        book.mark(key)


# --- OffloadNode: orphans and gone nodes -----------------------------------------------------


async def sweep_node(
    name: str, body: kopf.Body, memo: OperatorMemo, logger: kopf.Logger, **_: Any
) -> None:
    """Remove the OffloadNode of a gone node; else decide reclaims from its inventory.

    Every write is made here, through the writer, never through kopf's patch of the timer:
    kopf applies that patch outside the handler, and an error there (a 422 from the server)
    ends the object's timer for good. An error here is the handler's: kopf logs it, the
    metrics count it, and the next sweep runs as usual (wiring: errors are temporary).
    """
    memo.book.tick()
    views = memo.views
    cluster = views.get()
    node = parse_offload_node(body)
    if node is None:
        return  # no node is named so: nothing speaks for it, nothing to decide
    writer = memo.writer
    reason = removal_reason(node, cluster)
    if reason is not None:
        # Only on a current view: in the shared one a Node or a heartbeat seen less than
        # SNAPSHOT_SECONDS ago can be missing, and a live node's OffloadNode was deleted so.
        reason = removal_reason(node, views.get(fresh=True))
    if reason is not None:
        post_event(body, Announcement(True, EventReason.NODE_GONE, reason))
        await writer.delete_offload_node(name)
        metrics.TOTALS.set_node_orphans(name, None)
        return

    decision = _decide_reclaims(node, cluster, memo)
    if decision.forget_retained:
        # Only on a current view: in the shared one a region released less than
        # SNAPSHOT_SECONDS ago can still look live, as if it claimed its retained files again;
        # forgetting their retention then would have them reclaimed as orphans.
        decision = _decide_reclaims(node, views.get(fresh=True), memo)
    reclaims = reclaims_after(node, decision, cluster.now)
    if reclaims is not None:
        await writer.edit_offload_node_spec(name, lambda _spec: {"reclaims": reclaims})
    if decision.forget_retained:
        await writer.edit_offload_node_spec(name, forget_retained(decision.forget_retained))
    memo.orphan_clock = decision.clock  # only once written: a failed sweep is decided again
    if decision.deferred:
        logger.info(
            f"{len(decision.deferred)} more orphans are due than spec.reclaims can hold "
            f"(at most {MAX_RECLAIMS} at once): they are requested as earlier ones are answered"
        )
    metrics.TOTALS.set_node_orphans(name, len(decision.orphans), decision.orphaned_bytes)
    metrics.count_reclaim_decision(decision)
    for note in announcements(decision):
        post_event(body, note)


def _decide_reclaims(
    node: OffloadNode, cluster: ClusterSnapshot, memo: OperatorMemo
) -> OrphanDecision:
    config = operator_config(memo)
    return decide_reclaims(
        node,
        cluster.region_paths,
        orphan_clock(memo),
        cluster.now,
        config.orphan_grace_seconds,
        config.orphan_dry_run,
        live_paths=cluster.live_region_paths,
    )


async def offload_node_changed(
    type: str, name: str, meta: kopf.Meta, memo: OperatorMemo, **_: Any
) -> None:
    if type == "DELETED":
        metrics.TOTALS.set_node_orphans(name, None)
        return
    # kopf's timer finalizer was once named as the regions' is: kopf no longer removes it
    ops = remove_ops(meta, FINALIZER)
    if ops is not None:
        await memo.writer.json_patch(NODE_PLURAL, None, name, ops)
