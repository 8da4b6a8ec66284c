"""Object metadata rules the API server enforces on every kind."""

from __future__ import annotations

import datetime
import re
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

from tests.kube.errors import Cause

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Fields only the server sets: an update or patch cannot change them.
SYSTEM_FIELDS = (
    "uid",
    "creationTimestamp",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_uid() -> str:
    return str(uuid.uuid4())


def generated_name(prefix: str) -> str:
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the API server's: no vowels, no lookalikes
    return prefix + "".join(secrets.choice(alphabet) for _ in range(5))


def name_causes(name: Any, *, label: bool) -> list[Cause]:
    """metadata.name rules: a DNS label (namespaces) or a DNS subdomain (everything else)."""
    if not isinstance(name, str) or not name:
        return [
            Cause(
                "metadata.name",
                "FieldValueRequired",
                "Required value: name or generateName is required",
            )
        ]
    limit, pattern, what = (
        (63, DNS_LABEL, "RFC 1123 label") if label else (253, DNS_SUBDOMAIN, "RFC 1123 subdomain")
    )
    if len(name) > limit or not pattern.fullmatch(name):
        return [
            Cause(
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": a lowercase {what} must consist of lower case '
                "alphanumeric "
                f"characters, '-' or '.', and must start and end with an alphanumeric character "
                f"(at most {limit} characters)",
            )
        ]
    return []


def finalizers(obj: Mapping[str, Any]) -> list[str]:
    return list((obj.get("metadata") or {}).get("finalizers") or [])


def is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What a generation counts: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}
