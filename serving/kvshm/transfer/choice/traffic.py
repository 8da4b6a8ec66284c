"""Jobs in flight per direction, shared by one worker's handlers.

Which backend moves a layout fastest can depend on whether the other direction is moving at
the same time: on some hosts the copy engines win one way while staging wins both ways at
once, because one thread issues both directions' descriptors (docs/transfer.md). A
handler given a Traffic and a backend for each case picks per job.
"""

from __future__ import annotations

from kvshm.transfer.metrics import Direction


class Traffic:
    """Counts of submitted, not yet retired jobs per direction (one thread, the engine's,
    submits and retires them, so plain counters do)."""

    def __init__(self) -> None:
        self._in_flight = dict.fromkeys(Direction, 0)

    def started(self, direction: Direction) -> None:
        self._in_flight[direction] += 1

    def finished(self, direction: Direction, jobs: int = 1) -> None:
        self._in_flight[direction] = max(0, self._in_flight[direction] - jobs)

    def other_busy(self, direction: Direction) -> bool:
        """Whether the other direction has jobs in flight."""
        return any(n > 0 for d, n in self._in_flight.items() if d is not direction)
