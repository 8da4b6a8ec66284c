"""Condition merging: transition times move only when a condition's status changes."""

from __future__ import annotations

from datetime import timedelta

from kvshm.api.conditions import Condition, ConditionType, merge_conditions
from tests.operator.builders import NOW


def test_new_conditions_get_the_current_time_and_generation() -> None:
    merged = merge_conditions(None, [Condition(ConditionType.READY, None, "Waiting", "m")], 4, NOW)
    assert merged == [
        {
            "type": "Ready",
            "status": "Unknown",
            "reason": "Waiting",
            "message": "m",
            "observedGeneration": 4,
            "lastTransitionTime": "2026-11-22T12:00:00Z",
        }
    ]


def test_same_status_keeps_time_but_updates_reason_and_message() -> None:
    first = merge_conditions(None, [Condition(ConditionType.READY, False, "A", "a")], 1, NOW)
    later = NOW + timedelta(hours=1)
    second = merge_conditions(first, [Condition(ConditionType.READY, False, "B", "b")], 2, later)
    assert second[0]["lastTransitionTime"] == "2026-11-22T12:00:00Z"
    assert (second[0]["reason"], second[0]["message"], second[0]["observedGeneration"]) == (
        "B",
        "b",
        2,
    )
    third = merge_conditions(second, [Condition(ConditionType.READY, True, "C", "c")], 2, later)
    assert third[0]["lastTransitionTime"] == "2026-11-22T13:00:00Z"


def test_conditions_of_other_types_are_kept() -> None:
    foreign = [{"type": "example.com/Audited", "status": "True"}]
    merged = merge_conditions(foreign, [Condition(ConditionType.READY, True, "R", "r")], 1, NOW)
    assert [c["type"] for c in merged] == ["example.com/Audited", "Ready"]
