"""The drain event: what the agent tells the workers attached to a region before it removes the
region's files. It travels on a kvshm.ipc queue in a ring file named EVENTS_RING in the region's
directory (docs/agent.md, "Drain"); the agent writes it and the vLLM plugin reads it, both
with this one schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EVENTS_RING = "kvshm_events"  # in the region's directory, next to its files
DRAIN_TYPE = "drain"


@dataclass(frozen=True)
class DrainEvent:
    """Stop using region (its "namespace/name") of engine instance_id before deadline."""

    region: str
    instance_id: str
    reason: str
    deadline: float
    """Unix time after which the agent removes the files even if a process still holds them."""

    def to_message(self) -> dict[str, Any]:
        return {
            "type": DRAIN_TYPE,
            "region": self.region,
            "instanceId": self.instance_id,
            "reason": self.reason,
            "deadline": self.deadline,
        }

    @classmethod
    def from_message(cls, message: Any) -> DrainEvent | None:
        """The event in a message off the ring, or None for anything else: the tenant can
        write the ring, so a message may be of any shape."""
        if not isinstance(message, dict) or message.get("type") != DRAIN_TYPE:
            return None
        try:
            return cls(
                str(message["region"]),
                str(message["instanceId"]),
                str(message.get("reason", "")),
                float(message["deadline"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
