"""Which reports a sink should publish now: changed ones at once, progress at most ~once a
second per region (populatedBytes while populating), so N regions populating do not flood the
API server or the terminal."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvshm.api import NodeReport


class ReportGate:
    def __init__(
        self, progress_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._progress_seconds = progress_seconds
        self._clock = clock
        self._published: dict[str, tuple[NodeReport, float]] = {}

    def due(self, reports: Mapping[str, NodeReport]) -> dict[str, NodeReport]:
        now = self._clock()
        due = {}
        for key, report in reports.items():
            last = self._published.get(key)
            if last is None or (
                last[0] != report
                and (
                    not report.differs_only_in_progress(last[0])
                    or now - last[1] >= self._progress_seconds
                )
            ):
                due[key] = report
        for key in list(self._published):
            if key not in reports:
                del self._published[key]
        return due

    def published(self, key: str, report: NodeReport) -> None:
        self._published[key] = (report, self._clock())

    def last(self) -> dict[str, NodeReport]:
        return {key: report for key, (report, _) in self._published.items()}
