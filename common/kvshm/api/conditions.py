"""Kubernetes-style status conditions, the one definition for both writers: the operator's on
an OffloadRegion (ConditionType) and the agent's on its OffloadNode (NodeConditionType). Typed
values, and merging that keeps transition times."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from kvshm.api.messages import MAX_CONDITION_MESSAGE, bounded
from kvshm.api.reading import format_timestamp


class ConditionType(StrEnum):
    """An OffloadRegion's conditions (the operator's)."""

    ACCEPTED = "Accepted"  # the spec is valid and its placement can work
    READY = "Ready"  # the region is ready on every node it belongs on
    DEGRADED = "Degraded"  # something is wrong on some node: reason and message say what
    DRAINED = "Drained"  # deletion: every node removed its files (or was given up on)


class NodeConditionType(StrEnum):
    """An OffloadNode's conditions (its agent's)."""

    ROOT_SAFE = "RootSafe"  # nothing unsafe (symlink, device, ...) found under the region root
    INVENTORY_COMPLETE = "InventoryComplete"  # every file of the root listed in the status
    HUGE_PAGES = "HugePages"  # region files get huge pages (reported where they are wanted)


@dataclass(frozen=True)
class Condition:
    type: ConditionType | NodeConditionType
    status: bool | None  # None: Unknown
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return {True: "True", False: "False", None: "Unknown"}[self.status]


def merge_conditions(
    current: Sequence[Mapping[str, Any]] | None,
    wanted: Iterable[Condition],
    generation: int | None,
    now: datetime,
    *,
    keep_unset: bool = True,
) -> list[dict[str, Any]]:
    """The conditions list to write: wanted ones replace those of their type.

    lastTransitionTime changes only when a condition's status changes, as kubectl and
    `kubectl wait --for=condition=Ready` expect. Types not in wanted are kept (keep_unset), or
    dropped where wanted is the whole list. observedGeneration only where a generation is given.
    """
    previous_by_type = {
        str(item.get("type")): dict(item) for item in current or () if isinstance(item, Mapping)
    }
    by_type = dict(previous_by_type) if keep_unset else {}
    for condition in wanted:
        previous = previous_by_type.get(condition.type.value)
        unchanged = previous is not None and previous.get("status") == condition.status_text
        written: dict[str, Any] = {
            "type": condition.type.value,
            "status": condition.status_text,
            "reason": condition.reason,
            "message": bounded(condition.message, MAX_CONDITION_MESSAGE),
        }
        if generation is not None:
            written["observedGeneration"] = generation
        written["lastTransitionTime"] = (
            previous.get("lastTransitionTime", format_timestamp(now))
            if unchanged and previous is not None
            else format_timestamp(now)
        )
        by_type[condition.type.value] = written
    return list(by_type.values())
