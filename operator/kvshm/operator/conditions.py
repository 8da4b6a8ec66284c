"""Kubernetes-style status conditions: typed values, and merging that keeps transition times."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from kvshm.api.messages import MAX_CONDITION_MESSAGE, bounded
from kvshm.api.reading import format_timestamp


class ConditionType(StrEnum):
    ACCEPTED = "Accepted"  # the spec is valid and its placement can work
    READY = "Ready"  # the region is ready on every node it belongs on
    DEGRADED = "Degraded"  # something is wrong on some node: reason and message say what
    DRAINED = "Drained"  # deletion: every node removed its files (or was given up on)


@dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: bool | None  # None: Unknown
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return {True: "True", False: "False", None: "Unknown"}[self.status]


def merge_conditions(
    current: Sequence[Mapping[str, Any]] | None,
    wanted: Iterable[Condition],
    generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """The conditions list to write: wanted ones replace those of their type.

    lastTransitionTime changes only when a condition's status changes, as kubectl and
    `kubectl wait --for=condition=Ready` expect. Types the operator does not set are kept.
    """
    by_type = {
        str(item.get("type")): dict(item) for item in current or () if isinstance(item, Mapping)
    }
    for condition in wanted:
        previous = by_type.get(condition.type.value)
        unchanged = previous is not None and previous.get("status") == condition.status_text
        by_type[condition.type.value] = {
            "type": condition.type.value,
            "status": condition.status_text,
            "reason": condition.reason,
            "message": bounded(condition.message, MAX_CONDITION_MESSAGE),
            "observedGeneration": generation,
            "lastTransitionTime": (
                previous.get("lastTransitionTime", format_timestamp(now))
                if unchanged and previous is not None
                else format_timestamp(now)
            ),
        }
    return list(by_type.values())
