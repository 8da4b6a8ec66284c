"""Where a region belongs, and what the CRD schema cannot check about its placement.

A schema can say nodeNames is a list of names; only the cluster can say whether those Nodes
exist, whether a selector matches any, and whether any matching node's region root is large
enough. The verdict distinguishes specs that will never work (Rejected: fix the spec) from ones
that may once agents report (Waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvshm.api import OffloadRegion, RegionPlacement
from kvshm.api.messages import summarize
from kvshm.operator.cluster import AgentState, ClusterSnapshot


class Verdict(StrEnum):
    ACCEPTED = "Accepted"
    WAITING = "Waiting"  # may work once agents report: retry later
    REJECTED = "Rejected"  # will not work until the spec (or the cluster) changes


class PlacementReason(StrEnum):
    ACCEPTED = "Accepted"
    UNKNOWN_NODE = "UnknownNode"
    NO_MATCHING_NODE = "NoMatchingNode"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"
    WAITING_FOR_AGENTS = "WaitingForAgents"


@dataclass(frozen=True)
class Placement:
    verdict: Verdict
    reason: PlacementReason
    message: str
    targets: tuple[str, ...] = ()  # existing nodes the region belongs on, sorted


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def place(region: OffloadRegion, cluster: ClusterSnapshot) -> Placement:
    """The nodes a region belongs on, and whether its placement can work at all."""
    wanted = region.placement
    if not wanted.node_names and not wanted.node_selector:
        # No placement: every node that runs an agent.
        targets = tuple(sorted(name for name in cluster.agents if cluster.node_known(name)))
        if not targets:
            return Placement(
                Verdict.WAITING,
                PlacementReason.WAITING_FOR_AGENTS,
                "no kvshm agent has reported on any node yet: is the agent DaemonSet running?",
            )
        return _check_capacity(region, cluster, targets)

    unknown = [name for name in wanted.node_names if not cluster.node_known(name)]
    # named nodes are looked up, not searched for among every Node (thousands, each decision)
    candidates = wanted.node_names or tuple(cluster.nodes)
    matching = {
        name
        for name in candidates
        if name in cluster.nodes and wanted.matches(name, cluster.nodes[name])
    }
    if not wanted.node_selector:  # a deleted Node's labels are unknown: only names can match
        matching |= {name for name in wanted.node_names if cluster.node_known(name)}
    targets = tuple(sorted(matching))
    if unknown:
        return Placement(
            Verdict.REJECTED,
            PlacementReason.UNKNOWN_NODE,
            f"spec.placement.nodeNames lists {summarize(unknown)}, which "
            f"{'is not a Node' if len(unknown) == 1 else 'are not Nodes'} of this cluster: "
            "fix the names (kubectl get nodes) or remove them",
            targets,
        )
    if not targets:
        return Placement(
            Verdict.REJECTED,
            PlacementReason.NO_MATCHING_NODE,
            f"spec.placement matches none of the cluster's {len(cluster.nodes)} nodes "
            f"({_describe(wanted)}): "
            "label a node to match, or change the placement",
        )
    return _check_capacity(region, cluster, targets)


def _check_capacity(
    region: OffloadRegion, cluster: ClusterSnapshot, targets: tuple[str, ...]
) -> Placement:
    capacities = {
        name: cluster.agents[name].status.capacity_bytes
        for name in targets
        if name in cluster.agents and cluster.agents[name].status.capacity_bytes is not None
    }
    # what each node's root holds for the region: more than its size where the root rounds a
    # file's last huge page up (its agent reports how its pages behave)
    needed = {
        name: cluster.agents[name].status.allocation_bytes(region.layout) for name in capacities
    }
    if any(
        capacity >= needed[name] for name, capacity in capacities.items() if capacity is not None
    ):
        return Placement(Verdict.ACCEPTED, PlacementReason.ACCEPTED, "placement accepted", targets)
    unmeasured = [name for name in targets if name not in capacities]
    if unmeasured:
        return Placement(
            Verdict.WAITING,
            PlacementReason.WAITING_FOR_AGENTS,
            f"waiting for {summarize(unmeasured)} to report the capacity of the region root: "
            + _why_unmeasured(cluster, unmeasured[0]),
            targets,
        )
    largest = max(capacity for capacity in capacities.values() if capacity is not None)
    size = min(needed.values())
    return Placement(
        Verdict.REJECTED,
        PlacementReason.INSUFFICIENT_CAPACITY,
        f"the region needs {size} bytes ({_gib(size)}) but the largest region root among the "
        f"matching nodes holds {largest} bytes ({_gib(largest)}): lower spec.layout.numBlocks "
        "or place it on nodes with more shared memory",
        targets,
    )


def _describe(placement: RegionPlacement) -> str:
    labels = [f"{key}={value}" for key, value in placement.node_selector.items()]
    parts = []
    if placement.node_names:
        parts.append(f"nodeNames {summarize(placement.node_names, 'names')}")
    if labels:
        parts.append(f"nodeSelector {summarize(labels, 'labels')}")
    return ", ".join(parts)


def _why_unmeasured(cluster: ClusterSnapshot, node: str) -> str:
    if cluster.agent_state(node) is AgentState.ALIVE:
        return f"the agent on {node} has not measured it yet"
    return cluster.silence_message(node)
