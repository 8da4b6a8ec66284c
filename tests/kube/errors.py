"""Kubernetes API errors as the API server reports them: an HTTP status and a v1 Status body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Cause:
    """One field-level reason of an Invalid (422) answer, as in Status.details.causes."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    message: str


@dataclass
class ApiError(Exception):
    """Raised by the emulator's handlers; rendered as a Status object with this code."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(kind: str, group: str, name: str | None) -> dict[str, Any]:
    details: dict[str, Any] = {"kind": kind, "group": group} if group else {"kind": kind}
    if name:
        details["name"] = name
    return details


def not_found(plural: str, group: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(
        404, "NotFound", f'{qualified} "{name}" not found', _details(plural, group, name)
    )


def already_exists(plural: str, group: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(
        409, "AlreadyExists", f'{qualified} "{name}" already exists', _details(plural, group, name)
    )


def conflict(plural: str, group: str, name: str, why: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    message = f'Operation cannot be fulfilled on {qualified} "{name}": {why}'
    return ApiError(409, "Conflict", message, _details(plural, group, name))


def invalid(kind: str, group: str, name: str, causes: list[Cause]) -> ApiError:
    """422 Invalid, worded like the API server: `Kind.group "name" is invalid: [field: msg]`."""
    qualified = f"{kind}.{group}" if group else kind
    listed = ", ".join(f"{c.field}: {c.message}" if c.field else c.message for c in causes)
    text = listed if len(causes) == 1 else f"[{listed}]"
    details = _details(kind, group, name)
    details["causes"] = [
        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
    ]
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {text}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)
