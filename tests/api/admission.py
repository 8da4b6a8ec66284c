"""What the API server (the emulator, with the project's CRDs) makes of an OffloadRegion."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from tests.kube.errors import ApiError
from tests.kube.resources import CRD_TYPE
from tests.kube.runner import CRD_DIR, load_crds
from tests.kube.store import Store

REGION_CRD = next(c for c in load_crds(CRD_DIR) if c["spec"]["names"]["kind"] == "OffloadRegion")
REGION_SCHEMA: Mapping[str, Any] = REGION_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def fresh_store() -> Store:
    store = Store()
    store.create(CRD_TYPE, None, copy.deepcopy(REGION_CRD))
    return store


def admit(manifest: Mapping[str, Any], store: Store | None = None) -> dict[str, Any] | ApiError:
    """The stored object (defaults applied) or the API server's refusal."""
    store = store or fresh_store()
    regions = store.resource("kvshm.dev", "v1alpha1", "offloadregions")
    namespace = (manifest.get("metadata") or {}).get("namespace") or "default"
    try:
        return store.create(regions, namespace, copy.deepcopy(dict(manifest)))
    except ApiError as exc:
        return exc


def schema_nodes(
    schema: Mapping[str, Any], path: str = ""
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every (dotted path, schema) in a structural schema; map values and list items as [*]."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from schema_nodes(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from schema_nodes(schema["additionalProperties"], f"{path}[*]")
    if isinstance(schema.get("items"), Mapping):
        yield from schema_nodes(schema["items"], f"{path}[*]")


def rules(schema: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every x-kubernetes-validations rule with the path it sits at."""
    return [
        (path, rule)
        for path, node in schema_nodes(schema)
        for rule in node.get("x-kubernetes-validations", ())
    ]
