"""Reading what the API server holds for kvshm's status records: leniently (a missing or
malformed field reads as its safe default) and bounded (nothing read is larger than the CRD
schema allows), with timestamps at the precision status keeps (kvshm.api.status)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

# maxItems of the OffloadNode lists (the CRD's): more entries are not read
MAX_INVENTORY_FILES = 10000
MAX_RECLAIMS = 1000
MAX_RETAINED = 10000
MAX_PATH = 1024  # maxLength of every path in OffloadNode
MAX_REPORT_PATH = 4096  # maxLength of status.nodes.<node>.path
MAX_AGENT_VERSION = 128
MAX_REASON = 1024  # maxLength of spec.reclaims[].reason
MAX_INT64 = (1 << 63) - 1  # an integer field's format: int64
MAX_REGION_KEY = 317  # maxLength of claimedBy and retained[].region: <namespace>/<name>


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC to the second, the way Kubernetes writes timestamps."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: object) -> datetime | None:
    """An RFC 3339 timestamp as Kubernetes writes it ('2026-01-02T03:04:05Z'), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return whole_seconds(parsed)


def whole_seconds(moment: datetime) -> datetime:
    """The moment in UTC without its fraction of a second: what a status timestamp keeps."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).replace(microsecond=0)


def maybe_whole_seconds(moment: datetime | None) -> datetime | None:
    return None if moment is None else whole_seconds(moment)


def read_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_nonnegative(value: object) -> int | None:
    """A non-negative integer field; anything else reads as None."""
    number = read_int(value)
    return number if number is not None and number >= 0 else None


def read_count(value: object) -> int:
    """A non-negative integer field; anything else reads as 0."""
    number = read_nonnegative(value)
    return 0 if number is None else number


def read_str(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def keep_field(record: object, name: str, value: object) -> None:
    object.__setattr__(record, name, value)  # normalising a frozen record in __post_init__


def read_entries(value: object, limit: int) -> list[Mapping[str, Any]]:
    """The entries of a list-map keyed by path (the CRDs' form), at most `limit`, each path
    once (the first wins); a plain map path -> entry is read the same way."""
    if isinstance(value, Mapping):
        value = [
            {**entry, "path": path} for path, entry in value.items() if isinstance(entry, Mapping)
        ]
    if not isinstance(value, list):
        return []
    seen: set[str] = set()
    entries: list[Mapping[str, Any]] = []
    for entry in value:
        if len(entries) >= limit:
            break
        if not isinstance(entry, Mapping):
            continue
        path = entry.get("path")
        if isinstance(path, str) and path and len(path) <= MAX_PATH and path not in seen:
            seen.add(path)
            entries.append(entry)
    return entries
