"""Polling for a condition in tests that drive real processes and servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | None], timeout: float = 20.0, what: str = "", interval: float = 0.05
) -> T:
    """The first truthy probe() within timeout, else AssertionError naming what was awaited."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or probe}; last: {last!r}")
