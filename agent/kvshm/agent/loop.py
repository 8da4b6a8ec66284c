"""The agent's main loop: source -> reconciler -> sink, on every change and every resync.

One small interface each for where regions come from (a directory of YAML files, or the
Kubernetes API) and where status goes (stdout, or status patches and Events): local and
cluster mode run this same loop and the same reconciler.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from kvshm.agent.errors import ErrorReason
from kvshm.agent.metrics import AgentMetrics
from kvshm.agent.reconciler import NodeReconciler
from kvshm.agent.reports import PassResult
from kvshm.agent.server import Health
from kvshm.agent.view import ClusterView

log = logging.getLogger(__name__)


class RegionSource(Protocol):
    def start(self, wake: Callable[[], None]) -> None:
        """Begin watching; call wake() whenever something changed."""
        ...

    def synced(self) -> bool:
        """Whether the first full listing is in (before it, nothing may be drained)."""
        ...

    def view(self) -> ClusterView: ...

    def close(self) -> None: ...


class StatusSink(Protocol):
    def publish(self, result: PassResult) -> None: ...

    def close(self) -> None: ...


class Wakeup:
    """Wakes the loop early: a source saw a change, a region finished opening, or stop."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def __call__(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()


class AgentLoop:
    def __init__(
        self,
        source: RegionSource,
        reconciler: NodeReconciler,
        sink: StatusSink,
        metrics: AgentMetrics,
        health: Health,
        wakeup: Wakeup,
        *,
        resync_seconds: float,
        progress_seconds: float = 1.0,
    ) -> None:
        self.source = source
        self.reconciler = reconciler
        self.sink = sink
        self.metrics = metrics
        self.health = health
        self.wakeup = wakeup
        self.resync_seconds = resync_seconds
        self.progress_seconds = progress_seconds

    def run_pass(self) -> PassResult:
        result = self.reconciler.reconcile(self.source.view())
        self.metrics.observe(result)  # first: what a status line says is already scrapable
        self.sink.publish(result)
        self.health.passed()
        return result

    def run(self, stop: threading.Event, *, until_settled: bool = False) -> PassResult | None:
        """Reconcile until stop is set (or, with until_settled, until nothing is in progress)."""
        self.source.start(self.wakeup)
        while not stop.is_set() and not self.source.synced():
            self.wakeup.wait(self.progress_seconds)
        result = None
        while not stop.is_set():
            try:
                result = self.run_pass()
            except Exception:  # one bad pass must not stop the node's agent; the next retries
                log.exception("reconcile pass failed; retrying")
                self.metrics.error(ErrorReason.IO)
                self.wakeup.wait(self.progress_seconds)
                continue
            if until_settled and result.settled:
                break
            self.wakeup.wait(self.progress_seconds if result.busy else self.resync_seconds)
        return result
