"""What the reconciler counts as it goes; kvshm.agent.metrics.AgentMetrics implements it."""

from __future__ import annotations

from typing import Protocol

from kvshm.agent.drain.drainer import DrainOutcome
from kvshm.agent.errors import ErrorReason
from kvshm.api import ReclaimOutcome


class Counters(Protocol):
    def populated(self, seconds: float, size_bytes: int) -> None: ...
    def drained(self, outcome: DrainOutcome) -> None: ...
    def reclaimed(self, outcome: ReclaimOutcome) -> None: ...
    def error(self, reason: ErrorReason) -> None: ...


class NoCounters:
    def populated(self, seconds: float, size_bytes: int) -> None:
        pass

    def drained(self, outcome: DrainOutcome) -> None:
        pass

    def reclaimed(self, outcome: ReclaimOutcome) -> None:
        pass

    def error(self, reason: ErrorReason) -> None:
        pass
