"""The operator's Prometheus metrics (names as in docs/metrics.md), in a registry of its own,
served on /metrics by kvshm.endpoints' bounded server (the agent's, with the same limits).

A dedicated registry keeps kopf's or a test process's other collectors out of /metrics, and
lets several in-process operator runs (tests) read their own numbers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from functools import wraps
from typing import ParamSpec, TypeVar

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvshm.api import ReclaimOutcome, RegionPhase
from kvshm.endpoints import BoundedHttpServer, metrics_route, serve
from kvshm.operator.orphans import OrphanDecision, Refusal

REGISTRY = CollectorRegistry()

RECONCILES = Counter(
    "kvshm_operator_reconciles_total",
    "Operator handler runs, by handler and outcome.",
    ["handler", "outcome"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvshm_operator_reconcile_duration_seconds",
    "Time spent in one operator handler run.",
    ["handler"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    registry=REGISTRY,
)
REGIONS = Gauge(
    "kvshm_operator_regions",
    "OffloadRegions by status.phase.",
    ["phase"],
    registry=REGISTRY,
)
ORPHANED_FILES = Gauge(
    "kvshm_operator_orphaned_files",
    "Region files no region claims and no process holds, over all nodes.",
    registry=REGISTRY,
)
ORPHANED_BYTES = Gauge(
    "kvshm_operator_orphaned_bytes",
    "Bytes of those orphaned files.",
    registry=REGISTRY,
)
RECLAIMS_REQUESTED = Counter(
    "kvshm_operator_reclaims_requested_total",
    "Reclaims written into OffloadNode specs.",
    registry=REGISTRY,
)
RECLAIMS_COMPLETED = Counter(
    "kvshm_operator_reclaims_completed_total",
    "Reclaims the agents reported done.",
    registry=REGISTRY,
)
DECISIONS_REFUSED = Counter(
    "kvshm_operator_decisions_refused_total",
    "Reclaims not requested because they were unsafe, by reason.",
    ["reason"],
    registry=REGISTRY,
)

for _phase in RegionPhase:
    REGIONS.labels(phase=_phase.value)
for _refusal in Refusal:
    DECISIONS_REFUSED.labels(reason=_refusal.value)


def count_reclaim_decision(decision: OrphanDecision) -> None:
    """A sweep's decision in the reclaim counters: requests written, refusals and withdrawals
    by reason, reclaims the agents reported done."""
    RECLAIMS_REQUESTED.inc(len(decision.requests))
    for refused in (*decision.refusals, *decision.withdrawals):
        DECISIONS_REFUSED.labels(reason=refused.reason.value).inc()
    done = sum(result.outcome is ReclaimOutcome.DONE for result in decision.results)
    RECLAIMS_COMPLETED.inc(done)


class PerKeyTotals:
    """Gauges that are sums over objects (regions by phase, orphans over nodes).

    Each object reports its own contribution; the gauge is the sum, so an object that
    disappears is simply forgotten and nothing is double counted.
    """

    def __init__(self) -> None:
        self._region_phases: dict[str, str] = {}
        self._phase_counts = dict.fromkeys((item.value for item in RegionPhase), 0)
        self._orphans: dict[str, tuple[int, int]] = {}
        self._orphan_totals = [0, 0]  # files, bytes

    def set_region_phase(self, region: str, phase: RegionPhase | None) -> None:
        # counted as they change, not recounted: every region event of thousands lands here
        before = self._region_phases.pop(region, None)
        if before is not None:
            self._phase_counts[before] -= 1
            REGIONS.labels(phase=before).set(self._phase_counts[before])
        if phase is not None:
            self._region_phases[region] = phase.value
            self._phase_counts[phase.value] += 1
            REGIONS.labels(phase=phase.value).set(self._phase_counts[phase.value])

    def set_node_orphans(self, node: str, files: int | None, size: int = 0) -> None:
        # as set_region_phase: every sweep of every node lands here
        before_files, before_size = self._orphans.pop(node, (0, 0))
        self._orphan_totals[0] -= before_files
        self._orphan_totals[1] -= before_size
        if files is not None:
            self._orphans[node] = (files, size)
            self._orphan_totals[0] += files
            self._orphan_totals[1] += size
        ORPHANED_FILES.set(self._orphan_totals[0])
        ORPHANED_BYTES.set(self._orphan_totals[1])

    @property
    def region_phases(self) -> Mapping[str, str]:
        return dict(self._region_phases)


TOTALS = PerKeyTotals()

P = ParamSpec("P")
R = TypeVar("R")


def outcome(error: BaseException | None) -> str:
    if error is None:
        return "success"
    if isinstance(error, kopf.TemporaryError):
        return "temporary_error"
    if isinstance(error, kopf.PermanentError):
        return "permanent_error"
    return "error"


def instrumented(
    handler: str,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[..., Awaitable[R]]]:
    """Count and time every run of an async kopf handler under `handler`.

    The wrapper's signature is left open (kopf passes everything by keyword, including the
    indexes a handler asks for by name), which also lets it satisfy kopf's callback protocols.
    """

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        @wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                return await fn(*args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                RECONCILE_SECONDS.labels(handler=handler).observe(time.perf_counter() - started)
                RECONCILES.labels(handler=handler, outcome=outcome(error)).inc()

        return run

    return decorate


_served: BoundedHttpServer | None = None


def serve_once(port: int, address: str = "0.0.0.0") -> BoundedHttpServer | None:
    """Serve /metrics on port (0: do not serve); a restarted operator in one process reuses the
    first server."""
    global _served
    if port and _served is None:
        _served = serve(
            address, port, {"/metrics": metrics_route(REGISTRY)}, thread_name="kvshm-operator-http"
        )
    return _served


def sample(name: str, labels: Mapping[str, str] | None = None) -> float:
    """A current sample value from this registry (0 when absent): for tests and benchmarks."""
    value = REGISTRY.get_sample_value(name, dict(labels or {}))
    return value if value is not None else 0.0
