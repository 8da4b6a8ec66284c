"""Operator metrics: names from docs/metrics.md, handler outcomes, sums over objects."""

from __future__ import annotations

import re
from pathlib import Path

import kopf
import pytest

from kvshm.api import RegionPhase
from kvshm.operator import metrics
from kvshm.operator.metrics import PerKeyTotals, instrumented, sample

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_documented_operator_metric_is_exposed_and_nothing_else() -> None:
    section = DOC.read_text().split("## Operator", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| (kvshm_operator_\w+) \|", section, re.MULTILINE))
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.REGISTRY.collect()
    }
    assert documented and exposed == documented


async def test_instrumented_counts_outcomes_by_exception_kind() -> None:
    def runs(outcome: str) -> float:
        return sample("kvshm_operator_reconciles_total", {"handler": "t", "outcome": outcome})

    @instrumented("t")
    async def handler(error: BaseException | None = None) -> str:
        if error is not None:
            raise error
        return "ok"

    before = {o: runs(o) for o in ("success", "temporary_error", "permanent_error", "error")}
    assert await handler() == "ok"
    for error in (kopf.TemporaryError("t"), kopf.PermanentError("p"), ValueError("v")):
        with pytest.raises(type(error)):
            await handler(error)
    after = {o: runs(o) - before[o] for o in before}
    assert after == {"success": 1, "temporary_error": 1, "permanent_error": 1, "error": 1}
    assert sample("kvshm_operator_reconcile_duration_seconds_count", {"handler": "t"}) >= 4


def test_region_phase_gauge_is_a_sum_that_forgets_deleted_regions() -> None:
    totals = PerKeyTotals()
    totals.set_region_phase("t/a", RegionPhase.READY)
    totals.set_region_phase("t/b", RegionPhase.READY)
    totals.set_region_phase("t/b", RegionPhase.DEGRADED)
    assert sample("kvshm_operator_regions", {"phase": "Ready"}) == 1
    assert sample("kvshm_operator_regions", {"phase": "Degraded"}) == 1
    totals.set_region_phase("t/a", None)
    assert sample("kvshm_operator_regions", {"phase": "Ready"}) == 0


def test_orphan_gauges_sum_over_nodes() -> None:
    totals = PerKeyTotals()
    totals.set_node_orphans("a", 2, 100)
    totals.set_node_orphans("b", 1, 50)
    assert sample("kvshm_operator_orphaned_files") == 3
    assert sample("kvshm_operator_orphaned_bytes") == 150
    totals.set_node_orphans("a", None)
    assert sample("kvshm_operator_orphaned_bytes") == 50
