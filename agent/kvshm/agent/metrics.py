"""The agent's Prometheus metrics, named exactly as docs/metrics.md lists them.

Gauges are read from the latest reconcile pass when scraped, so a region that is gone has no
series left behind. Served as the Prometheus text format (0.0.4).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvshm.agent.drain.drainer import DrainOutcome
from kvshm.agent.errors import ErrorReason
from kvshm.agent.reports import PassResult
from kvshm.api import NodeRegionPhase, ReclaimOutcome

POPULATE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_HOLDING_FILE = (
    NodeRegionPhase.CREATING,
    NodeRegionPhase.POPULATING,
    NodeRegionPhase.READY,
    NodeRegionPhase.DRAINING,
)


class _PassCollector:
    """Gauges from the latest pass, and the populated-bytes counter (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._result: PassResult | None = None
        self._heartbeat = 0.0
        self.populated_total = 0.0

    def observe(self, result: PassResult, now: float) -> None:
        with self._lock:
            self._result, self._heartbeat = result, now

    def add_populated(self, size_bytes: int) -> None:
        with self._lock:
            self.populated_total += size_bytes

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            result, heartbeat, populated_total = self._result, self._heartbeat, self.populated_total
        yield CounterMetricFamily(
            "kvshm_agent_populate_bytes_total",
            "Bytes populated (throughput: its rate over the rate of populate_seconds_sum).",
            value=populated_total,
        )
        yield GaugeMetricFamily(
            "kvshm_agent_heartbeat_timestamp_seconds",
            "Unix time of the last completed reconcile pass.",
            value=heartbeat,
        )
        yield from _region_gauges(result or PassResult())
        yield from _root_gauges(result or PassResult())


def _region_gauges(result: PassResult) -> Iterator[Metric]:
    by_phase = GaugeMetricFamily(
        "kvshm_agent_regions", "Regions on this node by node phase.", labels=["phase"]
    )
    phase = GaugeMetricFamily(
        "kvshm_agent_region_phase",
        "Current node phase of each region (1 for its phase, 0 for the others).",
        labels=["region", "phase"],
    )
    size = GaugeMetricFamily(
        "kvshm_agent_region_size_bytes", "Size of each region (all its files).", labels=["region"]
    )
    populated = GaugeMetricFamily(
        "kvshm_agent_region_populated_bytes",
        "Bytes of each region populated so far.",
        labels=["region"],
    )
    totals = {"allocated": 0, "populated": 0, "locked": 0}
    counts = dict.fromkeys(NodeRegionPhase, 0)
    for key, report in sorted(result.reports.items()):
        if report.phase is not None:  # always, for the agent's own reports
            counts[report.phase] += 1
        for each in NodeRegionPhase:
            phase.add_metric([key, each.value], 1.0 if each is report.phase else 0.0)
        if report.phase in _HOLDING_FILE:
            size.add_metric([key], report.size_bytes)
            populated.add_metric([key], report.populated_bytes)
            totals["allocated"] += report.size_bytes
            totals["populated"] += report.populated_bytes
            totals["locked"] += report.size_bytes if report.locked else 0
    for each, count in counts.items():
        by_phase.add_metric([each.value], count)
    yield from (by_phase, phase, size, populated)
    other = GaugeMetricFamily(
        "kvshm_agent_region_other_files_bytes",
        "Bytes the tmpfs holds for a Ready region's tenant's other files in its directory "
        "(the warm-restart index included; at least, where more entries than are looked at).",
        labels=["region"],
    )
    allowed = GaugeMetricFamily(
        "kvshm_agent_region_other_files_allowed_bytes",
        "What a Ready region's tenant may keep beside it: its index's size and "
        "--tenant-files-bytes.",
        labels=["region"],
    )
    for key, found in sorted(result.tenant_files.items()):
        other.add_metric([key], found.bytes)
        allowed.add_metric([key], found.allowed_bytes)
    yield from (other, allowed)
    yield GaugeMetricFamily(
        "kvshm_agent_allocated_bytes",
        "Sum of region file sizes on this node.",
        value=totals["allocated"],
    )
    yield GaugeMetricFamily(
        "kvshm_agent_populated_bytes", "Sum of populated bytes.", value=totals["populated"]
    )
    yield GaugeMetricFamily(
        "kvshm_agent_locked_bytes", "Sum of mlocked bytes.", value=totals["locked"]
    )


def _root_gauges(result: PassResult) -> Iterator[Metric]:
    if result.root_scan is None:
        return
    inventory = result.root_scan.inventory
    orphans = inventory.orphans
    yield GaugeMetricFamily(
        "kvshm_agent_root_capacity_bytes",
        "Size of the region root's filesystem.",
        value=inventory.capacity_bytes,
    )
    yield GaugeMetricFamily(
        "kvshm_agent_root_free_bytes",
        "Free bytes of the region root's filesystem.",
        value=inventory.free_bytes,
    )
    if inventory.pages is not None:
        yield GaugeMetricFamily(
            "kvshm_agent_root_page_size_bytes",
            "Bytes of the pages a region file gets on the region root (huge pages: 2 MiB).",
            value=inventory.pages.size_bytes,
        )
    yield GaugeMetricFamily(
        "kvshm_agent_orphaned_files",
        "Region-shaped files no region claims.",
        value=len(orphans),
    )
    yield GaugeMetricFamily(
        "kvshm_agent_orphaned_bytes",
        "Bytes of the region-shaped files no region claims.",
        value=sum(f.size_bytes for f in orphans),
    )


class AgentMetrics:
    """The agent's registry; also the reconciler's Counters."""

    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        info = Gauge("kvshm_agent_info", "Agent build.", ["version"], registry=self.registry)
        info.labels(version).set(1)
        self._populate_seconds = Histogram(
            "kvshm_agent_populate_seconds",
            "Time to populate one region.",
            buckets=POPULATE_BUCKETS,
            registry=self.registry,
        )
        self._reclaims = Counter(
            "kvshm_agent_reclaims_total", "Reclaims executed.", ["outcome"], registry=self.registry
        )
        self._drains = Counter(
            "kvshm_agent_drains_total",
            "Region removals after a drain.",
            ["outcome"],
            registry=self.registry,
        )
        self._errors = Counter(
            "kvshm_agent_errors_total", "Errors by reason.", ["reason"], registry=self.registry
        )
        self._inventory_omitted = Gauge(
            "kvshm_agent_inventory_omitted_files",
            "Inventory entries left out of the OffloadNode (over its bounds).",
            registry=self.registry,
        )
        self._watch_restarts = Counter(
            "kvshm_agent_watch_restarts_total",
            "API watch streams restarted.",
            registry=self.registry,
        )
        # every bounded label value exists from the start, so rate() and alerts see zeros
        for reclaim in ReclaimOutcome:
            self._reclaims.labels(reclaim.value)
        for drain in (DrainOutcome.RELEASED, DrainOutcome.GRACE_EXPIRED):
            self._drains.labels(drain.value)
        for reason in ErrorReason:
            self._errors.labels(reason.value)
        self._pass = _PassCollector()
        self.registry.register(self._pass)

    # Counters (called by the reconciler and the sources/sinks)

    def populated(self, seconds: float, size_bytes: int) -> None:
        self._populate_seconds.observe(seconds)
        self._pass.add_populated(size_bytes)

    def drained(self, outcome: DrainOutcome) -> None:
        label = DrainOutcome.GRACE_EXPIRED if outcome is DrainOutcome.GRACE_EXPIRED else "released"
        self._drains.labels(str(label)).inc()

    def reclaimed(self, outcome: ReclaimOutcome) -> None:
        self._reclaims.labels(outcome.value).inc()

    def error(self, reason: ErrorReason) -> None:
        self._errors.labels(reason.value).inc()

    def inventory_omitted(self, entries: int) -> None:
        self._inventory_omitted.set(entries)

    def watch_restarted(self) -> None:
        self._watch_restarts.inc()

    def observe(self, result: PassResult) -> None:
        self._pass.observe(result, time.time())
