"""A Ready region's warm-restart index as its status reports it (status.nodes.<node>.warmIndex):
what the last engine that started on the region made of the index, read from the index's header
(kvshm.region.index.reader.read_outcome; docs/warm-restart.md). The engine writes that outcome at
its start; the agent only reads it, once a pass, and never trusts it: every value is bounded
before it reaches the status."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime

from kvshm.agent.errors import describe
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.api import OffloadRegion, WarmIndexReport, WarmIndexState
from kvshm.region.index.reader import IndexReading, read_outcome

log = logging.getLogger(__name__)


def read_warm_index(root: RegionRoot, region: OffloadRegion) -> WarmIndexReport:
    """The region's index as the status says it; never raises on what the tenant's file or
    directory holds (what cannot be read is Unreadable, with why)."""
    try:
        return _read_warm_index(root, region)
    except Exception as exc:  # a tenant's file may fail one region's report, never the pass
        log.exception("the warm index of %s could not be read", region.key)
        return WarmIndexReport(
            WarmIndexState.UNREADABLE, f"the agent could not read it ({type(exc).__name__})"
        )


def _read_warm_index(root: RegionRoot, region: OffloadRegion) -> WarmIndexReport:
    try:
        region_dir = root.open_region_dir(region.namespace, region.name)
        if region_dir is None:
            return WarmIndexReport(WarmIndexState.ABSENT)
        with region_dir:
            reading = read_outcome(region_dir.fd, region.instance_id, region_dir.path)
    except OSError as exc:
        return WarmIndexReport(WarmIndexState.UNREADABLE, describe(exc))
    return warm_index_report(reading)


def warm_index_report(reading: IndexReading) -> WarmIndexReport:
    if not reading.present:
        return WarmIndexReport(WarmIndexState.ABSENT)
    outcome = reading.outcome
    if outcome is None:
        return WarmIndexReport(WarmIndexState.UNREADABLE, reading.problem)
    state = WarmIndexState.WARM if outcome.state == "warm" else WarmIndexState.COLD
    return WarmIndexReport(
        state,
        outcome.reason,
        outcome.chunks,
        _moment(outcome.at),
    )


def _moment(seconds: float) -> datetime | None:
    """An outcome's time (seconds since the epoch, from the tenant's file), or None if it is
    none a timestamp can say."""
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        return None
