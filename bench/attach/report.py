"""bench/attach's figures: each way of opening a region timed from a common start (PathTimes),
their medians over runs, and the table run.py prints."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from bench.region_common import Geometry


@dataclass
class PathTimes:
    """One way of opening the region, its slowest rank, in seconds from the common start."""

    open_ready: float
    register: float | None
    blocking_inline: float | None
    transfer_ready: float | None
    stall: float | None

    @classmethod
    def of(cls, ranks: list[dict[str, Any]]) -> PathTimes:
        start = min(rank["start"] for rank in ranks)
        open_ready = max(rank["ready"] for rank in ranks) - start
        if "reg_start" not in ranks[0]:
            return cls(open_ready, None, None, None, None)
        unpinned = [
            (rank["rank"], rank.get("reg_error", "")) for rank in ranks if not rank["pinned"]
        ]
        if unpinned:
            raise SystemExit(f"registration failed (rank, error): {unpinned}; see warnings above")
        durations = [rank["reg_end"] - rank["reg_start"] for rank in ranks]
        return cls(
            open_ready,
            max(durations),
            max(rank["ready"] + d for rank, d in zip(ranks, durations, strict=True)) - start,
            max(rank["reg_end"] for rank in ranks) - start,
            max(rank["stall"] for rank in ranks),
        )

    @property
    def blocking_background(self) -> float | None:
        """Blocking time with registration in a background thread (None: not registered)."""
        return None if self.register is None else self.open_ready


PATHS = ("vllm_creator", "vllm_joiner", "kvshm_attach", "kvshm_cells")
LABELS = {
    "vllm_creator": "vLLM 0.33 creator (its own region)",
    "vllm_joiner": "vLLM 0.33 joiner of the agent's region",
    "kvshm_attach": "kvshm attach of the agent's region",
    "kvshm_cells": "  the same, its cells registered (*)",
}


def median_times(runs: list[PathTimes]) -> PathTimes:
    def median(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return statistics.median(present) if present else None

    fields = [list(column) for column in zip(*(asdict(run).values() for run in runs), strict=True)]
    open_ready = median(fields[0])
    assert open_ready is not None
    return PathTimes(open_ready, *(median(column) for column in fields[1:]))


def seconds(value: float | None, width: int = 10) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.4f}"


def print_table(gib: float, tp: int, times: dict[str, PathTimes], agent: dict[str, Any]) -> None:
    geometry = Geometry.for_size(gib, tp)
    print(f"\n{geometry.describe()}")
    print(
        f"  agent's region made beforehand: populate {agent['populate_s']:.3f} s "
        f"({geometry.size_bytes / agent['populate_s'] / 1e9:.2f} GB/s), {agent['locked']}"
    )
    header = (
        f"  {'path':<40}{'open->ready':>12}{'register':>10}{'inline':>10}"
        f"{'bg reg':>10}{'xfer-ready':>11}{'stall ms':>10}"
    )
    print(header)
    for path in (path for path in PATHS if path in times):
        t = times[path]
        stall = f"{'-':>10}" if t.stall is None else f"{t.stall * 1e3:>10.1f}"
        print(
            f"  {LABELS[path]:<40}{seconds(t.open_ready, 12)}{seconds(t.register)}"
            f"{seconds(t.blocking_inline)}{seconds(t.blocking_background)}"
            f"{seconds(t.transfer_ready, 11)}{stall}"
        )
    if "kvshm_cells" in times:
        print(
            "  (*) the plugin's worker: pin(cells_only=True), each row's cell of this rank, "
            "as vLLM registers its slots"
        )
    kvshm = times["kvshm_attach"]
    for path in ("vllm_creator", "vllm_joiner"):
        other = times[path]
        if other.blocking_inline is not None and kvshm.blocking_background is not None:
            goal = "  (goal >= 8x at TP 4)" if path == "vllm_creator" else ""
            print(
                f"  {LABELS[path]} inline / kvshm attach, registration in background: "
                f"{other.blocking_inline / kvshm.blocking_background:.1f}x{goal}"
            )
        print(
            f"  {LABELS[path]} / kvshm attach, open->ready only: "
            f"{other.open_ready / kvshm.open_ready:.1f}x"
        )


def print_pages(
    gib: float, tp: int, times: dict[str, dict[str, PathTimes]], agents: dict[str, Any]
) -> None:
    """--compare-pages: each path on each root ("4 KiB", "2 MiB"), and 4 KiB over 2 MiB."""
    geometry = Geometry.for_size(gib, tp)
    print(f"\n{geometry.describe()}")
    for name, agent in agents.items():
        print(
            f"  agent's region on {name} pages: populate {agent['populate_s']:.3f} s "
            f"({geometry.size_bytes / agent['populate_s'] / 1e9:.2f} GB/s), {agent['locked']}"
        )
    print(f"  {'path':<40}{'pages':>7}{'open->ready':>12}{'register':>10}{'xfer-ready':>11}")
    small, huge = times["4 KiB"], times["2 MiB"]
    for path in (path for path in PATHS if path in small):
        for name in times:
            t = times[name][path]
            print(
                f"  {LABELS[path]:<40}{name:>7}{seconds(t.open_ready, 12)}{seconds(t.register)}"
                f"{seconds(t.transfer_ready, 11)}"
            )
        slow, fast = small[path].register, huge[path].register
        if slow is not None and fast is not None:
            goal = "  (goal >= 1.5x at TP 4)" if path == "kvshm_cells" else ""
            print(f"    registration, 4 KiB / 2 MiB pages: {slow / fast:.2f}x{goal}")
        else:
            print(
                f"    no registration (no CUDA): open->ready, 4 KiB / 2 MiB pages: "
                f"{small[path].open_ready / huge[path].open_ready:.2f}x"
            )
