"""When a deleted region's finalizer may go: every node that held it has removed its files.

A node whose agent cannot answer any more (its Node is gone, or its agent is silent past the
timeout) is given up on rather than blocking deletion forever; that is reported, because its
files may still be there — they surface as unclaimed in that node's inventory if it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from kvshm.api import NodeReport, ReclaimPolicy
from kvshm.api.messages import summarize
from kvshm.operator.cluster import AgentState, ClusterSnapshot


class AbandonReason(StrEnum):
    NODE_GONE = "NodeGone"
    AGENT_SILENT = "AgentSilent"


@dataclass(frozen=True)
class Abandoned:
    node: str
    reason: AbandonReason
    message: str


@dataclass(frozen=True)
class DeletionDecision:
    release: bool  # the finalizer may be removed now
    waiting: tuple[str, ...] = ()  # nodes whose agents are still removing the files
    abandoned: tuple[Abandoned, ...] = ()  # nodes given up on (files may remain)
    retained: tuple[str, ...] = ()  # Retain: nodes whose files stay, unclaimed

    @property
    def reason(self) -> str:
        if self.retained:
            return "Retained"
        if self.waiting:
            return "Draining"
        if self.abandoned:
            return self.abandoned[0].reason.value
        return "FilesRemoved"

    @property
    def summary(self) -> str:
        if self.retained:
            return (
                f"reclaimPolicy Retain: the files stay on {summarize(self.retained)}, "
                "unclaimed, until a region claims them again or they are reclaimed"
            )
        if self.waiting:
            return f"waiting for {summarize(self.waiting)} to remove the region's files"
        if self.abandoned:
            first = self.abandoned[0]
            more = len(self.abandoned) - 1
            others = f" (and {more} more: {summarize([a.node for a in self.abandoned[1:]])})"
            return f"gave up on {first.node}: {first.message}" + (others if more else "")
        return "every node removed the region's files"


def decide_release(
    policy: ReclaimPolicy, reports: Mapping[str, NodeReport], cluster: ClusterSnapshot
) -> DeletionDecision:
    holding = sorted(node for node, report in reports.items() if report.holds_files)
    if policy is ReclaimPolicy.RETAIN:
        return DeletionDecision(release=True, retained=tuple(holding))
    waiting: list[str] = []
    abandoned: list[Abandoned] = []
    for node in holding:
        if cluster.node_gone(node):
            abandoned.append(
                Abandoned(
                    node,
                    AbandonReason.NODE_GONE,
                    f"node {node} no longer exists and its agent is not reporting",
                )
            )
        elif cluster.agent_state(node) is not AgentState.ALIVE:
            abandoned.append(
                Abandoned(node, AbandonReason.AGENT_SILENT, cluster.silence_message(node))
            )
        else:
            waiting.append(node)
    return DeletionDecision(release=not waiting, waiting=tuple(waiting), abandoned=tuple(abandoned))
