"""The operator's snapshot of the cluster at one moment: Nodes, agents and their liveness.

Built from kopf's in-memory indexes, so a decision reads a consistent snapshot and the plain
decision functions take it as one argument (and tests build it by hand).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TypeVar

from kvshm.api import OffloadNode

T = TypeVar("T")


_DERIVED = ("region_paths", "live_region_paths")  # ClusterSnapshot's cached properties


class AgentState(StrEnum):
    ALIVE = "Alive"
    SILENT = "Silent"  # its OffloadNode's heartbeat is older than the silence timeout
    MISSING = "Missing"  # no OffloadNode: the agent never started there, or was removed


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the operator's decisions see: unlike the agent's ClusterView (one node's regions),
    every Node and every agent's OffloadNode. Keys are node names (kvshm.api.NodeName)."""

    nodes: Mapping[str, Mapping[str, str]]  # Node name -> its labels
    agents: Mapping[str, OffloadNode]  # node name -> its OffloadNode
    now: datetime
    silence_seconds: float
    regions: Mapping[str, str] = field(default_factory=dict)  # region key -> its file 0 path
    live_regions: Mapping[str, str] = field(default_factory=dict)  # those not being deleted

    @functools.cached_property
    def region_paths(self) -> frozenset[str]:
        """Every region's file 0 path, built once a snapshot: every node's sweep reads it."""
        return frozenset(self.regions.values())

    @functools.cached_property
    def live_region_paths(self) -> frozenset[str]:
        return frozenset(self.live_regions.values())

    def at(self, now: datetime) -> ClusterSnapshot:
        """This snapshot as of `now`, sharing the path sets derived from it (built once for
        every decision that reads the snapshot, not once for each)."""
        moved = dataclasses.replace(self, now=now)
        for name in _DERIVED:
            moved.__dict__[name] = getattr(self, name)  # where cached_property keeps it
        return moved

    def agent_state(self, node: str) -> AgentState:
        agent = self.agents.get(node)
        if agent is None:
            return AgentState.MISSING
        age = agent.status.heartbeat_age(self.now)
        if age is None or age > self.silence_seconds:
            return AgentState.SILENT
        return AgentState.ALIVE

    def node_exists(self, node: str) -> bool:
        return node in self.nodes

    def node_known(self, node: str) -> bool:
        """A Node of the cluster, or a live agent speaking for one whose Node was deleted (it
        still holds and serves its regions: they degrade, they do not fail)."""
        return self.node_exists(node) or self.agent_state(node) is AgentState.ALIVE

    def node_gone(self, node: str) -> bool:
        """The Node object is gone and nothing speaks for the node any more."""
        return not self.node_exists(node) and self.agent_state(node) is not AgentState.ALIVE

    def silence_message(self, node: str) -> str:
        """Why the agent on node does not count as alive, for conditions and Events."""
        state = self.agent_state(node)
        if state is AgentState.MISSING:
            return f"node {node} has no OffloadNode: is the kvshm agent running there?"
        inventory = self.agents[node].status
        if inventory.heartbeat is None:
            return f"the kvshm agent on {node} has not reported a heartbeat yet"
        age = inventory.heartbeat_age(self.now) or 0.0
        return (
            f"the kvshm agent on {node} is silent: last heartbeat {age:.0f}s ago "
            f"(timeout {self.silence_seconds:.0f}s); check the agent pod on that node"
        )


def first_values(index: Mapping[str, Collection[T]]) -> dict[str, T]:
    """One value per key of a kopf index (each key is indexed from exactly one object)."""
    return {key: next(iter(store)) for key, store in index.items() if store}


class Snapshots:
    """One snapshot of kopf's indexes for `max_age` seconds, its `now` fresh at each get: every
    sweep (hundreds a second at thousands of nodes) and region decision copied every Node,
    OffloadNode and region path for itself."""

    def __init__(self, build: Callable[[], ClusterSnapshot], max_age: float) -> None:
        self._build, self._max_age = build, max_age
        self._taken: tuple[float, ClusterSnapshot] | None = None

    def get(self, fresh: bool = False) -> ClusterSnapshot:
        """The shared snapshot; fresh: one copied now (for a decision a stale view makes
        unsafe), which the next gets share."""
        taken = time.monotonic()
        if fresh or self._taken is None or taken - self._taken[0] > self._max_age:
            self._taken = (taken, self._build())
        return self._taken[1].at(datetime.now(UTC))
