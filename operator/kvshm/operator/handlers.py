"""kopf handlers: thin and typed. Each reads what kopf hands it, calls a plain decision function
(placement, phases, deletion, orphans, nodes) and applies the result as a patch, Events and
metrics. Nothing here decides anything on its own, so every rule is unit-tested without kopf.

The decorators are applied in kvshm.operator.wiring.register, with the configured intervals.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from kvshm.api import (
    InvalidAddressError,
    OffloadNode,
    OffloadRegion,
    ReclaimOutcome,
    ReclaimPolicy,
    RegionAddress,
    RegionPhase,
    SpecError,
    parse_node_reports,
    parse_offload_node,
    parse_offload_region,
    region_key,
)
from kvshm.api.reading import MAX_RECLAIMS, format_timestamp
from kvshm.operator import metrics
from kvshm.operator.backoff import backoff_seconds
from kvshm.operator.cluster import ClusterSnapshot, first_values
from kvshm.operator.config import OperatorConfig
from kvshm.operator.deletion import decide_release
from kvshm.operator.kube import ClusterWriter, KubernetesClientWriter, SpecRefused
from kvshm.operator.nodes import (
    add_retained,
    forget_retained,
    reclaims_after,
    removal_reason,
    retained_entry,
)
from kvshm.operator.orphans import OrphanClock, OrphanDecision, decide_reclaims
from kvshm.operator.phases import (
    ANNOUNCED_PHASES,
    RegionStatus,
    derive_invalid,
    derive_status,
    status_patch,
    worth_writing,
)
from kvshm.operator.placement import Verdict, place
from kvshm.operator.settings import FINALIZER, configure

# a waiting placement is re-validated after placement_retry_seconds, then twice as long each
# time, up to this
PLACEMENT_RETRY_MAX_SECONDS = 300.0


def _now() -> datetime:
    return datetime.now(UTC)


def _config(memo: kopf.Memo) -> OperatorConfig:
    config = getattr(memo, "config", None)
    if not isinstance(config, OperatorConfig):  # only before start-up has run
        config = memo.config = OperatorConfig.from_env()
    return config


# --- start-up --------------------------------------------------------------------------------


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Settings for kvshm; the config comes from main() through the memo, else from the env."""
    config = _config(memo)
    configure(settings, config)
    if getattr(memo, "writer", None) is None:
        memo.writer = KubernetesClientWriter()
    metrics.serve_once(config.metrics_port)


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


def _cluster(
    config: OperatorConfig,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    region_paths: kopf.Index[str, str] | None = None,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes=first_values(node_labels),
        agents=first_values(agents),
        now=_now(),
        silence_seconds=config.agent_silence_seconds,
        regions=first_values(region_paths) if region_paths is not None else {},
    )


# --- OffloadRegion: validation --------------------------------------------------------------


def _parse(body: kopf.Body) -> OffloadRegion:
    try:
        return parse_offload_region(body)
    except SpecError as exc:
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid OffloadRegion: {exc}") from exc


async def validate(
    body: kopf.Body,
    memo: kopf.Memo,
    retry: int,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    **_: Any,
) -> None:
    """Reject what the schema cannot: unknown nodes, an empty match, a size no node holds.

    The condition itself is written by the status reconcile (same rules, same cycle, on every
    event); this handler gives kopf the verdict: never retry a bad spec, retry a waiting one,
    less often the longer it waits (a node that never runs an agent is waited for forever).
    """
    config = _config(memo)
    placement = place(_parse(body), _cluster(config, node_labels, agents))
    if placement.verdict is Verdict.REJECTED:
        # one Event per rejected generation: kopf does not retry a permanent error
        kopf.warn(body, reason=placement.reason.value, message=placement.message)
        raise kopf.PermanentError(placement.message)
    if placement.verdict is Verdict.WAITING:
        delay = backoff_seconds(config.placement_retry_seconds, retry, PLACEMENT_RETRY_MAX_SECONDS)
        raise kopf.TemporaryError(placement.message, delay=delay)


# --- OffloadRegion: status, level-based ------------------------------------------------------


def _derive(body: kopf.Body, cluster: ClusterSnapshot) -> RegionStatus:
    generation = int(body.get("metadata", {}).get("generation") or 0)
    try:
        region = parse_offload_region(body)
    except SpecError as exc:
        return derive_invalid(f"invalid OffloadRegion: {exc}", generation)
    deleting = bool(body.get("metadata", {}).get("deletionTimestamp"))
    return derive_status(region, parse_node_reports(body.get("status")), cluster, deleting)


def _reconcile(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, cluster: ClusterSnapshot, *, level: bool
) -> None:
    """Bring status to what the reports say now.

    Events for one object can arrive faster than our own patch comes back, each with a body
    that does not show it yet; the event path therefore skips a result it already sent
    (memo.sent). The timer (level=True) always compares with the object as it is.
    """
    if FINALIZER not in body.metadata.get("finalizers", ()) and not body.metadata.get(
        "deletionTimestamp"
    ):
        # kopf adds the finalizer in this cycle; a status write now would race it (kopf
        # re-adds it from the stale echo of our own write, and can miss the create handler)
        return
    derived = _derive(body, cluster)
    key = region_key(str(body.metadata.namespace), str(body.metadata.name))
    metrics.TOTALS.set_region_phase(key, derived.phase)
    sent: RegionStatus | None = getattr(memo, "sent", None)
    if not level and not worth_writing(sent, derived):
        return
    current = body.get("status") or {}
    changes = status_patch(current, derived, cluster.now)
    if changes:
        patch.status.update(changes)
    memo.sent = derived
    previous = sent.phase.value if sent is not None else current.get("phase")
    if previous != derived.phase.value and derived.phase in ANNOUNCED_PHASES:
        _announce_phase(body, previous, derived)
    for node in derived.gone_nodes:
        if sent is None or node not in sent.gone_nodes:
            kopf.warn(
                body,
                reason="NodeGone",
                message=f"node {node} no longer exists and its agent is silent: "
                "dropped it from status.nodes",
            )


def _announce_phase(body: kopf.Body, previous: str | None, derived: RegionStatus) -> None:
    message = f"{previous or 'new'} -> {derived.phase.value}: {derived.message}"
    if derived.phase in (RegionPhase.FAILED, RegionPhase.DEGRADED):
        kopf.warn(body, reason=derived.phase.value, message=message)
    else:
        kopf.info(body, reason=derived.phase.value, message=message)


async def region_changed(
    type: str,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    **_: Any,
) -> None:
    """Every change (an agent's report, a spec edit) re-derives the status at once."""
    if type == "DELETED":
        key = region_key(str(body.metadata.namespace), str(body.metadata.name))
        metrics.TOTALS.set_region_phase(key, None)
        return
    _reconcile(body, patch, memo, _cluster(_config(memo), node_labels, agents), level=False)


async def region_resync(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    **_: Any,
) -> None:
    """The level-based safety net: what changes with time alone (an agent going silent, a node
    disappearing) and anything a missed event left behind."""
    _reconcile(body, patch, memo, _cluster(_config(memo), node_labels, agents), level=True)


# --- OffloadRegion: deletion -----------------------------------------------------------------


async def release(
    body: kopf.Body,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    **_: Any,
) -> None:
    """Hold the finalizer until every node that held the region removed its files."""
    config = _config(memo)
    cluster = _cluster(config, node_labels, agents)
    try:
        region: OffloadRegion | None = parse_offload_region(body)
    except SpecError:
        region = None  # files, if any, are still reported in status.nodes and waited for
    spec_policy = (body.get("spec") or {}).get("reclaimPolicy")
    policy = (
        ReclaimPolicy.RETAIN if spec_policy == ReclaimPolicy.RETAIN.value else ReclaimPolicy.DELETE
    )
    decision = decide_release(policy, parse_node_reports(body.get("status")), cluster)
    if not decision.release:
        raise kopf.TemporaryError(decision.summary, delay=config.deletion_poll_seconds)
    if decision.retained and region is not None:
        await _mark_retained(body, memo, region, decision.retained)
        kopf.info(body, reason="Retained", message=decision.summary)
    for item in decision.abandoned:
        kopf.warn(body, reason=item.reason.value, message=f"released anyway: {item.message}")
    metrics.TOTALS.set_region_phase(region_key(namespace, name), None)


async def _mark_retained(
    body: kopf.Body, memo: kopf.Memo, region: OffloadRegion, nodes: tuple[str, ...]
) -> None:
    """Record retained files in their nodes' specs, so orphan reclaim leaves them alone.

    A record that cannot be written (a full list) is lost, with a Warning: the deletion goes
    on, since retrying would hold the finalizer for good."""
    writer: ClusterWriter = memo.writer
    entry = retained_entry(region.key, region.address.file_0_path, _now())
    for node in nodes:
        try:
            await writer.edit_offload_node_spec(node, add_retained(entry))
        except SpecRefused as exc:
            kopf.warn(
                body,
                reason="RetainNotRecorded",
                message=f"released anyway; on node {node}: {exc}",
            )


# --- OffloadNode: orphans and gone nodes -----------------------------------------------------


async def sweep_node(
    name: str,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    node_labels: kopf.Index[str, dict[str, str]],
    agents: kopf.Index[str, OffloadNode],
    region_paths: kopf.Index[str, str],
    live_region_paths: kopf.Index[str, str],
    **_: Any,
) -> None:
    """Remove the OffloadNode of a gone node; else decide reclaims from its inventory.

    Every write is made here, through the writer, never through kopf's patch of the timer:
    kopf applies that patch outside the handler, and an error there (a 422 from the server)
    ends the object's timer for good. An error here is the handler's: kopf logs it, the
    metrics count it, and the next sweep runs as usual (wiring: errors are temporary).
    """
    config = _config(memo)
    cluster = _cluster(config, node_labels, agents, region_paths)
    node = parse_offload_node(body)
    if node is None:
        return  # no node is named so: nothing speaks for it, nothing to decide
    writer: ClusterWriter = memo.writer
    reason = removal_reason(node, cluster)
    if reason is not None:
        kopf.warn(body, reason="NodeGone", message=reason)
        await writer.delete_offload_node(name)
        metrics.TOTALS.set_node_orphans(name, None)
        return

    decision = decide_reclaims(
        node,
        cluster.regions.values(),
        getattr(memo, "orphan_clock", None) or OrphanClock(),
        cluster.now,
        config.orphan_grace_seconds,
        config.orphan_dry_run,
        live_paths=first_values(live_region_paths).values(),
    )
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
    _announce_reclaims(body, decision)


def _announce_reclaims(body: kopf.Body, decision: OrphanDecision) -> None:
    for request in decision.requests:
        metrics.RECLAIMS_REQUESTED.inc()
        kopf.info(
            body,
            reason="ReclaimRequested",
            message=f"{request.path} ({request.size_bytes} bytes) is an orphan since "
            f"{format_timestamp(request.orphaned_since)}: asked the agent to reclaim it",
        )
    for request in decision.would_reclaim:
        kopf.info(
            body,
            reason="WouldReclaim",
            message=f"dry run: {request.path} ({request.size_bytes} bytes) is an orphan past "
            "the grace period and would be reclaimed",
        )
    for refused in decision.refusals:
        metrics.DECISIONS_REFUSED.labels(reason=refused.reason.value).inc()
        if refused.reason.value != "grace":
            kopf.info(body, reason="ReclaimRefused", message=refused.message)
    for withdrawn in decision.withdrawals:
        metrics.DECISIONS_REFUSED.labels(reason=withdrawn.reason.value).inc()
        kopf.warn(
            body,
            reason="ReclaimWithdrawn",
            message=f"withdrew the reclaim request: {withdrawn.message}",
        )
    for result in decision.results:
        if result.outcome is ReclaimOutcome.DONE:
            metrics.RECLAIMS_COMPLETED.inc()
            kopf.info(body, reason="Reclaimed", message=f"the agent reclaimed {result.path}")
        else:
            kopf.warn(
                body,
                reason="ReclaimNotDone",
                message=f"the agent did not reclaim {result.path}: {result.outcome.value} "
                f"{result.message}".strip(),
            )


async def offload_node_changed(type: str, name: str, **_: Any) -> None:
    if type == "DELETED":
        metrics.TOTALS.set_node_orphans(name, None)
