"""Exponential backoff: how long to wait before the next try of something that keeps failing."""

from __future__ import annotations

# 2**64 times any first delay is past every cap; a larger power would not fit a float
_MAX_DOUBLINGS = 64


def backoff_seconds(first: float, attempt: int, cap: float) -> float:
    """The wait before try `attempt` + 1 (attempt 0: first), doubling each time, at most cap."""
    return min(cap, first * 2.0 ** min(max(attempt, 0), _MAX_DOUBLINGS))
