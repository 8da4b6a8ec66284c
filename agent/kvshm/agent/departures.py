"""Regions leaving this node, one step each reconcile pass: drains begun for hosted regions no
longer wanted (deleted, placed elsewhere, a new instance id) and for files of regions not placed
here, failed regions given up and reports an earlier agent process left cleared to Removed, and
every drain advanced until its files are gone.

It works on the reconciler's records (one per region, shared with it: the reconciler opens and
reports regions, this takes them off the node) and tells its events through the reconciler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvshm.agent.counters import Counters
from kvshm.agent.drain.drainer import Drainer, DrainOutcome
from kvshm.agent.errors import ErrorReason, describe
from kvshm.agent.hosting import HostedRegion
from kvshm.agent.record import RegionRecord
from kvshm.agent.reports import EventReason
from kvshm.agent.view import ClusterView
from kvshm.api import InventoryFile, NodeRegionPhase, NodeReport, OffloadRegion
from kvshm.region import RegionError

log = logging.getLogger(__name__)

EventCallback = Callable[[EventReason, OffloadRegion, str], None]


class Departures:
    """Takes regions off the node for the reconciler, from its records and each pass's view."""

    def __init__(
        self,
        records: dict[str, RegionRecord],
        drainer: Drainer,
        counters: Counters,
        event: EventCallback,
    ) -> None:
        self._records = records  # the reconciler's: key -> everything known of the region
        self._drainer = drainer
        self._counters = counters
        self._event = event

    def run(
        self,
        view: ClusterView,
        desired: dict[str, OffloadRegion],
        files: tuple[InventoryFile, ...],
        given_up: list[OffloadRegion],
    ) -> None:
        """Begin the drains this pass found due, clear what was given up, advance every drain;
        `files`: the inventory's, `given_up`: the failed regions no longer wanted here."""
        self._release_unwanted(view, desired)
        self._drain_leftovers(view, desired, files)
        self._report_given_up(view, given_up)
        self._settle_earlier_reports(view, desired)
        self._advance_drains()

    def _record(self, key: str) -> RegionRecord:
        return self._records.setdefault(key, RegionRecord(key))

    def _release_unwanted(self, view: ClusterView, desired: dict[str, OffloadRegion]) -> None:
        for key, record in list(self._records.items()):
            hosted = record.hosted
            if hosted is None:
                continue
            if key in view.invalid:
                continue  # an unreadable spec changes nothing that exists (loses nothing)
            target = desired.get(key)
            if target is not None and target.instance_id == hosted.region.instance_id:
                continue
            if target is not None:
                reason = (
                    f"instanceId changed from {hosted.region.instance_id!r} to "
                    f"{target.instance_id!r}"
                )
            elif key in view.regions and not view.regions[key].deleting:
                reason = f"no longer placed on node {view.node_name}"
            else:
                reason = "region deleted"
            self._begin_drain(record, hosted.region, hosted, reason)

    def _drain_leftovers(
        self, view: ClusterView, desired: dict[str, OffloadRegion], files: tuple[InventoryFile, ...]
    ) -> None:
        """Files of regions that exist but are not placed here (the agent was down when the
        placement changed or the deletion started): drain those too."""
        for file in files:
            key = file.claimed_by
            known = view.regions.get(key)
            if known is None or key in desired:
                continue
            record = self._record(key)
            if record.hosted is not None or record.removed is not None:
                continue
            if known.region.instance_id not in record.drains:
                reason = "region deleted" if known.deleting else "not placed on this node"
                self._begin_drain(record, known.region, None, reason)

    def _report_given_up(self, view: ClusterView, given_up: list[OffloadRegion]) -> None:
        """A failed region no longer wanted here (deleted, or placed elsewhere) whose file is
        not on the node (the inventory found none to drain) is cleared and Removed: its last
        report, Failed, would otherwise hold its deletion forever."""
        for region in given_up:
            record = self._record(region.key)
            known = view.regions.get(region.key)
            if known is not None and region.instance_id not in record.drains:
                self._clear(record, region, known.deleting)

    def _settle_earlier_reports(self, view: ClusterView, desired: dict[str, OffloadRegion]) -> None:
        """A region deleted or placed elsewhere that this process knows nothing of, while its
        status.nodes.<node> still says this node may hold its files: a report an earlier agent
        process left (Failed; or Draining, when it stopped after removing the files). Nothing
        else would ever replace it, and the operator waits for it to say Removed."""
        for key, known in view.regions.items():
            if key in desired or key in self._records or not known.reported_holding:
                continue
            self._clear(self._record(key), known.region, known.deleting)

    def _clear(self, record: RegionRecord, region: OffloadRegion, deleting: bool) -> None:
        """Removed once nothing of the region is left on the node: drained if a file of it
        is there after all."""
        try:
            step = self._drainer.clear(region)
        except (RegionError, OSError) as exc:  # looked at again on the next pass
            log.warning(
                "could not look at what is left of region %s: %s", region.key, describe(exc)
            )
            return
        if step is None:
            why = "region deleted" if deleting else "not placed on this node"
            self._begin_drain(record, region, None, why)
            return
        record.note_removed(
            NodeReport(
                NodeRegionPhase.REMOVED, message=step.message, observed_generation=region.generation
            )
        )

    def _begin_drain(
        self, record: RegionRecord, region: OffloadRegion, hosted: HostedRegion | None, why: str
    ) -> None:
        record.draining(self._drainer.begin(region, hosted, why))
        self._event(EventReason.DRAINING, region, f"draining: {why}")

    def _advance_drains(self) -> None:
        for record in list(self._records.values()):
            for instance_id, drain in list(record.drains.items()):
                try:
                    step = self._drainer.advance(drain)
                except (RegionError, OSError) as exc:
                    drain.message = f"drain failed, retried on the next pass: {describe(exc)}"
                    self._counters.error(ErrorReason.DRAIN)
                    continue
                drain.message = step.message
                if step.outcome is None:
                    continue
                region = drain.region
                if step.outcome is not DrainOutcome.RETAINED:
                    self._counters.drained(step.outcome)
                record.drained(
                    instance_id,
                    NodeReport(
                        NodeRegionPhase.REMOVED,
                        message=step.message,
                        observed_generation=region.generation,
                    ),
                )
                self._event(EventReason.DRAINED, region, step.message)
