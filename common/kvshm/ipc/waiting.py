"""How a blocked writer or reader waits: spin, then sleep with back-off, with timeouts,
cancellation, periodic "still waiting" warnings and periodic checks on the other side."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvshm.ipc.errors import RingConfigError, RingTimeout, WaitCancelled

log = logging.getLogger(__name__)


class CancelEvent(Protocol):
    """threading.Event, multiprocessing.Event or anything with is_set()."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class WaitPolicy:
    """Tuning of waits. The defaults suit a process that dedicates itself to the queue.

    A thread that waits for messages in the background of a busy Python process should use
    spin_seconds=0: a spinning thread holds the GIL between polls and slows its neighbours.
    """

    spin_seconds: float = 0.002
    """Poll (yielding the CPU with sched_yield between polls) this long before sleeping."""
    min_sleep_seconds: float = 0.00005
    """First sleep after spinning; each later sleep doubles, up to max_sleep_seconds."""
    max_sleep_seconds: float = 0.002
    """Longest sleep: the worst extra latency of an idle side, and its idle wake-up rate."""
    warn_interval_seconds: float = 60.0
    """Log a "still waiting" warning this often during a long wait (not for indefinite ones)."""
    liveness_interval_seconds: float = 0.1
    """How often a blocked side checks that the other side's processes are alive."""
    peer_death_grace_seconds: float = 5.0
    """How long a dead peer may stay dead (for a replacement to take its place) before the
    wait fails with ReaderDiedError or WriterDiedError."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise RingConfigError(f"WaitPolicy.{name} must be a finite number ≥ 0: {value!r}")
        if self.min_sleep_seconds > self.max_sleep_seconds:
            raise RingConfigError(
                f"WaitPolicy.min_sleep_seconds ({self.min_sleep_seconds}) is above "
                f"max_sleep_seconds ({self.max_sleep_seconds})"
            )
        for name in ("warn_interval_seconds", "liveness_interval_seconds"):
            if getattr(self, name) == 0:
                raise RingConfigError(f"WaitPolicy.{name} must be above 0")


class Waiter:
    """One wait. Call pause() each time the awaited condition is found false.

    pause() raises RingTimeout past the deadline and WaitCancelled once cancel is set; it
    warns every warn_interval_seconds unless the wait is indefinite, and calls
    check(now) every liveness_interval_seconds (check raises to end the wait). After spinning
    it sleeps through park(seconds), time.sleep unless the caller can be woken earlier.
    """

    __slots__ = (
        "_cancel",
        "_check",
        "_deadline",
        "_describe",
        "_next_check",
        "_next_warning",
        "_park",
        "_policy",
        "_sleep",
        "_spin_until",
        "_started",
    )

    def __init__(
        self,
        policy: WaitPolicy,
        describe: Callable[[], str],
        *,
        timeout: float | None = None,
        cancel: CancelEvent | None = None,
        indefinite: bool = False,
        check: Callable[[float], None] | None = None,
        park: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise RingConfigError(f"timeout must be None or a number ≥ 0 seconds: {timeout!r}")
        now = time.monotonic()
        self._policy = policy
        self._describe = describe
        self._cancel = cancel
        self._check = check
        self._park = park
        self._started = now
        self._deadline = math.inf if timeout is None else now + timeout
        self._spin_until = now + policy.spin_seconds
        self._sleep = policy.min_sleep_seconds
        self._next_warning = math.inf if indefinite else now + policy.warn_interval_seconds
        self._next_check = now + policy.liveness_interval_seconds

    def pause(self) -> None:
        now = time.monotonic()
        if self._cancel is not None and self._cancel.is_set():
            raise WaitCancelled(f"cancelled: {self._describe()}")
        if now >= self._deadline:
            raise RingTimeout(f"timed out after {now - self._started:.3g} s: {self._describe()}")
        if now >= self._next_check and self._check is not None:
            self._check(now)
            self._next_check = now + self._policy.liveness_interval_seconds
        if now >= self._next_warning:
            log.warning("still waiting after %.0f s: %s", now - self._started, self._describe())
            self._next_warning = now + self._policy.warn_interval_seconds
        if now < self._spin_until:
            os.sched_yield()
            return
        self._park(min(self._sleep, max(self._deadline - now, 0.0)))
        self._sleep = min(self._sleep * 2, self._policy.max_sleep_seconds)
