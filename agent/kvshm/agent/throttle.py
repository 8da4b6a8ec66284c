"""An optional cap on populate throughput, so populating never starves a busy node's memory
bandwidth. It paces the populate threads from the progress callback they already call."""

from __future__ import annotations

import threading
import time


class RateLimit:
    """Sleeps the calling thread until `done` bytes fit under bytes_per_second since start."""

    def __init__(self, bytes_per_second: float) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"a populate rate must be positive, got {bytes_per_second}")
        self._rate = bytes_per_second
        self._started: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._started = time.monotonic()

    def pace(self, done: int) -> None:
        with self._lock:
            if self._started is None:
                self._started = time.monotonic()
            due = self._started + done / self._rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
