"""Discovery documents: what clients (kopf, kubectl, the kubernetes client) read first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tests.kube.errors import ApiError
from tests.kube.resources import ResourceType

SERVER_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-kvshm-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _versions(types: Iterable[ResourceType], group: str) -> list[str]:
    return sorted({t.version for t in types if t.group == group}, reverse=True)


def api_versions(address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


def _group(types: Iterable[ResourceType], group: str) -> dict[str, Any]:
    versions = _versions(types, group)
    if not versions:
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource (/apis/{group})"
        )
    entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(types: Iterable[ResourceType]) -> dict[str, Any]:
    types = list(types)
    groups = sorted({t.group for t in types if t.group})
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(types, g) for g in groups],
    }


def api_group(types: Iterable[ResourceType], group: str) -> dict[str, Any]:
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(types, group)}


def api_resource_list(types: Iterable[ResourceType], group: str, version: str) -> dict[str, Any]:
    selected = sorted(
        (t for t in types if t.group == group and t.version == version), key=lambda t: t.plural
    )
    if not selected:
        path = f"/apis/{group}/{version}" if group else f"/api/{version}"
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for t in selected for entry in t.discovery_entries()],
    }
