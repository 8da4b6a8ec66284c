"""Parsing Kubernetes API paths into what they address."""

from __future__ import annotations

from dataclasses import dataclass

from tests.kube.errors import ApiError
from tests.kube.resources import ResourceType


@dataclass(frozen=True)
class Target:
    group: str
    version: str
    plural: str | None = None  # None: the group-version's discovery document
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse(path: str, types: dict[tuple[str, str, str], ResourceType]) -> Target | None:
    """The resource a path addresses, or None for a path outside /api/<v> and /apis/<g>/<v>."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return Target(group, version)
    if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in types:
        namespace, rest = rest[1], rest[2:]  # /namespaces/<ns>/<plural>[/<name>[/<sub>]]
    else:
        namespace = None  # cluster-scoped, or the namespaces resource itself
    if len(rest) > 3:
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )
    plural, name, subresource = [*rest, None, None][:3]
    return Target(group, version, plural, namespace, name, subresource)
