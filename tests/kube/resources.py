"""The resource types the emulator serves: built-ins it knows, and custom ones from CRDs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False  # a /status subresource that alone may change .status
    schema: Mapping[str, Any] | None = None  # openAPIV3Schema of a CRD version
    printer_columns: tuple[Mapping[str, Any], ...] = ()
    custom: bool = False  # served from a CRD: needs RV on update, no strategic merge

    @property
    def api_version(self) -> str:
        return self.version if not self.group else f"{self.group}/{self.version}"

    @property
    def group_version(self) -> tuple[str, str]:
        return (self.group, self.version)

    def discovery_entries(self) -> list[dict[str, Any]]:
        """Its entries in an APIResourceList: the resource, then its subresources."""
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        if self.has_status:
            entries.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        return entries


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", False, "namespace", ("ns",), (), True),
    ResourceType("", "v1", "nodes", "Node", False, "node", ("no",), (), True),
    ResourceType("", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, "lease"),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        "customresourcedefinition",
        ("crd", "crds"),
        (),
        True,
    ),
)

CRD_TYPE = BUILTIN_TYPES[-1]


def types_from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of an apiextensions.k8s.io/v1 CRD."""
    spec = crd["spec"]
    names = spec["names"]
    result = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        result.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec["scope"] == "Namespaced",
                singular=names.get("singular", names["kind"].lower()),
                short_names=tuple(names.get("shortNames", ())),
                categories=tuple(names.get("categories", ())),
                has_status="status" in (version.get("subresources") or {}),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=tuple(version.get("additionalPrinterColumns", ())),
                custom=True,
            )
        )
    return result
