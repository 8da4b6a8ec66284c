"""Local mode's status sink: one line per change on stdout, and a table at the end."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvshm.agent.gate import ReportGate
from kvshm.agent.inventory import RootScan
from kvshm.agent.printable import encodable
from kvshm.agent.reports import EventReason, PassResult
from kvshm.agent.root.rootpages import describe_pages
from kvshm.agent.sizes import format_bytes
from kvshm.api import NodeRegionPhase, NodeReport
from kvshm.api.messages import printable

# Status lines already tell phase changes; these events add what a status line cannot.
_PRINTED_EVENTS = frozenset(
    {
        EventReason.CREATED,
        EventReason.ADOPTED,
        EventReason.LOCK_FAILED,
        EventReason.RECLAIMED,
        EventReason.RECLAIM_REFUSED,
    }
)


def _progress(report: NodeReport) -> str:
    if report.phase is NodeRegionPhase.CREATING:
        return format_bytes(report.size_bytes)
    if report.phase is NodeRegionPhase.POPULATING:
        return f"{format_bytes(report.populated_bytes)} of {format_bytes(report.size_bytes)}"
    if report.phase is NodeRegionPhase.READY:
        parts = [format_bytes(report.size_bytes)]
        if report.populate_seconds:
            rate = report.size_bytes / report.populate_seconds / 1e9
            parts.append(f"populated in {report.populate_seconds:.2f}s ({rate:.1f} GB/s)")
        elif report.populated_bytes < report.size_bytes:
            parts.append(f"{format_bytes(report.populated_bytes)} allocated (populate: false)")
        parts.append("locked" if report.locked else "not locked")
        return ", ".join(parts)
    return ""


def status_line(key: str, report: NodeReport) -> str:
    details = [d for d in (_progress(report), report.message) if d]
    if report.phase is NodeRegionPhase.READY and report.path:
        details.append(report.path)
    return f"{key}  {report.phase_name}  " + "  ".join(details)


def format_table(reports: dict[str, NodeReport], scan: RootScan | None) -> str:
    rows = [("REGION", "PHASE", "SIZE", "POPULATED", "LOCKED", "SECONDS", "PATH / MESSAGE")]
    for key, report in sorted(reports.items()):
        rows.append(
            (
                key,
                report.phase_name,
                format_bytes(report.size_bytes) if report.size_bytes else "-",
                format_bytes(report.populated_bytes) if report.size_bytes else "-",
                "yes" if report.locked else "no",
                f"{report.populate_seconds:.2f}" if report.populate_seconds else "-",
                report.message or report.path,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]
    if len(rows) == 1:
        lines.append("(no regions)")
    if scan is not None:
        inventory = scan.inventory
        pages = "" if inventory.pages is None else f", {describe_pages(inventory.pages)}"
        lines.append(
            f"root {scan.root}: {format_bytes(inventory.capacity_bytes or 0)} capacity, "
            f"{format_bytes(inventory.free_bytes or 0)} free{pages}"
        )
        for file in inventory.orphans:
            held = "held by a process" if file.held else "not held"
            lines.append(
                f"orphaned: {scan.root}/{file.path} ({format_bytes(file.size_bytes)}, "
                f"{held}): no region claims it; remove it once nothing uses it"
            )
    return "\n".join(lines)


class ConsoleSink:
    def __init__(self, out: TextIO | None = None, progress_seconds: float = 1.0) -> None:
        self._out = out or sys.stdout
        self._gate = ReportGate(progress_seconds)
        self._problems: tuple[str, ...] = ()
        self._last: PassResult | None = None

    def publish(self, result: PassResult) -> None:
        self._last = result
        for event in result.events:
            if event.reason in _PRINTED_EVENTS:
                self._print(f"{event.region_key or 'node'}  {event.reason.value}  {event.message}")
        for key, report in sorted(self._gate.due(result.reports).items()):
            self._print(status_line(key, report))
            self._gate.published(key, report)
        problems = tuple(result.problems) + (result.root_scan.problems if result.root_scan else ())
        for problem in problems:
            if problem not in self._problems:
                self._print(f"problem: {problem}")
        self._problems = problems
        self._out.flush()

    def close(self) -> None:
        if self._last is not None:
            table = format_table(self._last.reports, self._last.root_scan)
            lines = [printable(line) for line in table.split("\n")]
            self._out.write(encodable("\n".join(lines) + "\n", self._out))
            self._out.flush()

    def _print(self, line: str) -> None:
        # tenants choose file names that reach these lines: escapes are printed, not obeyed
        text = f"{time.strftime('%H:%M:%S')}  {printable(line)}\n"
        self._out.write(encodable(text, self._out))
