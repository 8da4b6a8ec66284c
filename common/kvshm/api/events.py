"""The reasons of the Kubernetes Events kvshm posts, the agent's and the operator's: one enum, so
that no two components post one reason with two meanings (docs/agent.md and docs/operator.md,
"Events"). Phases, placement and abandon reasons, typed where they are decided, are posted by
their own values."""

from __future__ import annotations

from enum import StrEnum


class EventReason(StrEnum):
    # the agent, on an OffloadRegion: its files on this node
    CREATED = "Created"
    ADOPTED = "Adopted"
    READY = "Ready"
    FAILED = "Failed"
    LOCK_FAILED = "LockFailed"
    DRAINING = "Draining"
    DRAINED = "Drained"
    # the agent, on its OffloadNode: a reclaim it executed or refused at its own re-check
    RECLAIMED = "Reclaimed"
    RECLAIM_REFUSED = "ReclaimRefused"
    # the operator, on an OffloadNode: its reclaim decisions and the agent's answers to them
    RECLAIM_REQUESTED = "ReclaimRequested"
    WOULD_RECLAIM = "WouldReclaim"  # dry run
    RECLAIM_NOT_REQUESTED = "ReclaimNotRequested"  # an orphan-looking file it left alone
    RECLAIM_WITHDRAWN = "ReclaimWithdrawn"
    RECLAIM_COMPLETED = "ReclaimCompleted"  # the agent answered Done
    RECLAIM_NOT_DONE = "ReclaimNotDone"
    # the operator, on an OffloadRegion or OffloadNode
    NODE_GONE = "NodeGone"
    RETAINED = "Retained"
    RETAIN_NOT_RECORDED = "RetainNotRecorded"
