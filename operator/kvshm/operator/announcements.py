"""An Event the operator owes an object: what every decision returns to announce, and the one
way it is posted. Decisions stay plain functions; only the handlers and the book post."""

from __future__ import annotations

from dataclasses import dataclass

import kopf


@dataclass(frozen=True)
class Announcement:
    """An Event about the object a decision was made for."""

    warning: bool
    reason: str  # an EventReason, or a region's phase
    message: str


def post(body: kopf.Body, note: Announcement) -> None:
    """Post `note` on `body` through kopf (a Warning or a Normal Event)."""
    send = kopf.warn if note.warning else kopf.info
    send(body, reason=note.reason, message=note.message)
