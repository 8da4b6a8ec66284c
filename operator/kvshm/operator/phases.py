"""A region's status, derived from its spec and every agent's report: one pure function.

Level-based: the result depends only on what is observed now (spec, status.nodes, Nodes and
OffloadNodes), never on which events were seen, so re-deriving after a missed event or an
operator restart gives the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvshm.api import NodeRegionPhase, NodeReport, OffloadRegion, RegionPhase
from kvshm.api.conditions import Condition, ConditionType, merge_conditions
from kvshm.api.messages import (
    MAX_CONDITION_MESSAGE,
    MAX_STATUS_MESSAGE,
    SHOWN,
    bounded,
    readable_bytes,
    summarize,
)
from kvshm.operator.cluster import AgentState, ClusterSnapshot
from kvshm.operator.deletion import decide_release
from kvshm.operator.placement import Placement, PlacementReason, Verdict, place


@dataclass(frozen=True)
class RegionStatus:
    phase: RegionPhase
    observed_generation: int
    conditions: tuple[Condition, ...]
    message: str
    size_bytes: int | None = None
    target_nodes: tuple[str, ...] = ()
    ready_nodes: int = 0
    gone_nodes: tuple[str, ...] = ()  # status.nodes entries whose node no longer exists

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((item for item in self.conditions if item.type is kind), None)


def _accepted(placement: Placement) -> Condition:
    status = {Verdict.ACCEPTED: True, Verdict.WAITING: None, Verdict.REJECTED: False}
    return Condition(
        ConditionType.ACCEPTED, status[placement.verdict], placement.reason.value, placement.message
    )


def derive_invalid(message: str, generation: int) -> RegionStatus:
    """A spec the API server let through but that kvshm cannot use (parse_offload_region)."""
    conditions = (
        Condition(ConditionType.ACCEPTED, False, "InvalidSpec", message),
        Condition(ConditionType.READY, False, "InvalidSpec", "the spec is not valid"),
    )
    return RegionStatus(RegionPhase.FAILED, generation, conditions, message)


def derive_status(
    region: OffloadRegion,
    reports: Mapping[str, NodeReport],
    cluster: ClusterSnapshot,
    deleting: bool = False,
) -> RegionStatus:
    placement = place(region, cluster)
    gone = tuple(sorted(node for node in reports if cluster.node_gone(node)))
    live = {node: report for node, report in reports.items() if node not in gone}
    accepted = _accepted(placement)
    if deleting:
        decision = decide_release(region.reclaim_policy, live, cluster)
        phase, message = RegionPhase.TERMINATING, decision.summary
        conditions: tuple[Condition, ...] = (
            accepted,
            Condition(ConditionType.READY, False, "Terminating", message),
            Condition(ConditionType.DRAINED, decision.release, decision.reason, message),
        )
    else:
        problems = _node_problems(placement.targets, live, cluster)
        if placement.reason is PlacementReason.UNKNOWN_NODE:
            problems.insert(0, (placement.reason.value, placement.message))
        phase, reason, message = _phase_of(placement, live, problems, region.generation)
        degraded = (
            Condition(ConditionType.DEGRADED, True, problems[0][0], _problems_message(problems))
            if problems
            else Condition(ConditionType.DEGRADED, False, "AsExpected", "no node reports a problem")
        )
        ready = Condition(ConditionType.READY, phase is RegionPhase.READY, reason, message)
        conditions = (accepted, ready, degraded)
    return RegionStatus(
        phase=phase,
        observed_generation=region.generation,
        conditions=conditions,
        message=message,
        size_bytes=region.size_bytes,
        target_nodes=placement.targets,
        ready_nodes=len(_ready(placement.targets, live, region.generation)),
        gone_nodes=gone,
    )


def _phase_of(
    placement: Placement,
    reports: Mapping[str, NodeReport],
    problems: list[tuple[str, str]],
    generation: int,
) -> tuple[RegionPhase, str, str]:
    """(phase, reason, message) of a region that is not being deleted; the first rule wins."""
    targets = placement.targets
    phases = [_phase(reports, node) for node in targets]
    if placement.verdict is Verdict.REJECTED and (
        placement.reason is not PlacementReason.UNKNOWN_NODE or not targets
    ):
        return RegionPhase.FAILED, placement.reason.value, placement.message
    if not targets or placement.verdict is Verdict.WAITING:
        return RegionPhase.PENDING, placement.reason.value, placement.message
    if all(phase is NodeRegionPhase.FAILED for phase in phases):
        return RegionPhase.FAILED, problems[0][0], problems[0][1]
    if problems:
        return RegionPhase.DEGRADED, problems[0][0], problems[0][1]
    ready = len(_ready(targets, reports, generation))
    if ready == len(targets):
        return RegionPhase.READY, "AllNodesReady", f"ready on {ready}/{len(targets)} nodes"
    if any(phase not in (None, NodeRegionPhase.PENDING) for phase in phases):
        return RegionPhase.PROVISIONING, "Provisioning", _progress_message(targets, reports)
    return (
        RegionPhase.PENDING,
        "Pending",
        f"waiting for the agents on {summarize(targets)} to start the region",
    )


def _ready(
    targets: tuple[str, ...], reports: Mapping[str, NodeReport], generation: int
) -> list[str]:
    return [node for node in targets if node in reports and reports[node].ready_for(generation)]


def _phase(reports: Mapping[str, NodeReport], node: str) -> NodeRegionPhase | None:
    report = reports.get(node)
    return report.phase if report is not None else None


def _node_problems(
    targets: tuple[str, ...], reports: Mapping[str, NodeReport], cluster: ClusterSnapshot
) -> list[tuple[str, str]]:
    """(reason, message) for every target node that cannot make progress, worst first."""
    failures = []
    deleted = []
    silences = []
    for node in targets:
        report = reports.get(node)
        if report is not None and report.phase is NodeRegionPhase.FAILED:
            detail = report.message or "no message"
            failures.append(("NodeFailed", f"failed on {node}: {detail}"))
        elif cluster.agent_state(node) is not AgentState.ALIVE:
            silences.append(("AgentSilent", cluster.silence_message(node)))
        elif not cluster.node_exists(node):
            deleted.append(node)
    if deleted:
        failures.append(
            (
                "NodeDeleted",
                f"the Node object of {summarize(deleted)} was deleted while the kvshm agent "
                "there still runs: the region is kept there until that agent stops or the node "
                "registers again",
            )
        )
    return failures + silences


def _progress_message(targets: tuple[str, ...], reports: Mapping[str, NodeReport]) -> str:
    """'provisioning (node-a: Ready, node-b: Creating)', or with many nodes, by phase:
    'provisioning (Ready: 40 nodes: a, b, c and 37 more; not reported: d)'."""
    by_phase: dict[str, list[str]] = {}
    for node in targets:
        phase = _phase(reports, node)
        by_phase.setdefault(phase.value if phase else "not reported", []).append(node)
    if len(targets) <= SHOWN:
        per_node = {node: phase for phase, nodes in by_phase.items() for node in nodes}
        parts = [f"{node}: {per_node[node]}" for node in targets]
    else:
        parts = [f"{phase}: {summarize(nodes)}" for phase, nodes in by_phase.items()]
    return f"provisioning ({', '.join(parts) if len(targets) <= SHOWN else '; '.join(parts)})"


def _problems_message(problems: list[tuple[str, str]]) -> str:
    """Every problem while they fit a condition's message; then the first ones and a count."""
    shown: list[str] = []
    for index, (_, message) in enumerate(problems):
        rest = len(problems) - index
        if sum(map(len, shown)) + len(message) > MAX_CONDITION_MESSAGE // 2:
            shown.append(f"and {rest} more problem{'s' if rest > 1 else ''}")
            break
        shown.append(message)
    return bounded("; ".join(shown), MAX_CONDITION_MESSAGE)


def status_patch(
    current: Mapping[str, Any] | None, derived: RegionStatus, now: datetime
) -> dict[str, Any]:
    """The merge patch that brings status to `derived`; empty when it is already there.

    Only operator-owned fields are written; status.nodes belongs to the agents, except for
    entries of nodes that no longer exist, which are removed (null in a merge patch).
    """
    current = current or {}
    wanted: dict[str, Any] = {
        "phase": derived.phase.value,
        "observedGeneration": derived.observed_generation,
        "message": bounded(derived.message, MAX_STATUS_MESSAGE),
        "nodesWanted": len(derived.target_nodes),
        "nodesReady": derived.ready_nodes,
        "conditions": merge_conditions(
            current.get("conditions"), derived.conditions, derived.observed_generation, now
        ),
        "sizeBytes": derived.size_bytes,  # None (an invalid spec has no size): null, removed
        "size": None if derived.size_bytes is None else readable_bytes(derived.size_bytes),
    }
    patch = {key: value for key, value in wanted.items() if current.get(key) != value}
    if derived.gone_nodes:
        patch["nodes"] = dict.fromkeys(derived.gone_nodes)
    return patch


def _signature(status: RegionStatus) -> tuple[object, ...]:
    return (
        status.phase,
        tuple((c.type, c.status, c.reason) for c in status.conditions),
        status.gone_nodes,
    )


def worth_writing(sent: RegionStatus | None, derived: RegionStatus) -> bool:
    """Whether derived differs enough from what was last sent to patch the object again.

    Any change counts, except while terminating: there only phase and condition reasons do
    (which node is still draining changes often, and the object is about to go).
    """
    if sent is None:
        return True
    if derived.phase is RegionPhase.TERMINATING and sent.phase is RegionPhase.TERMINATING:
        return _signature(sent) != _signature(derived)
    return sent != derived


# Transitions worth an Event: where a region became usable, or stopped being usable.
ANNOUNCED_PHASES = frozenset({RegionPhase.READY, RegionPhase.DEGRADED, RegionPhase.FAILED})
