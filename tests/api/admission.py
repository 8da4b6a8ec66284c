"""The project's CRDs as shipped (charts/kvshm/crds/), and walks over their schemas."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tests.envtest.chart import CRDS, load_documents

CRD_DOCUMENTS = [
    doc for path in sorted(CRDS.glob("*.yaml")) for doc in load_documents(path.read_text())
]
REGION_CRD = next(c for c in CRD_DOCUMENTS if c["spec"]["names"]["kind"] == "OffloadRegion")
REGION_SCHEMA: Mapping[str, Any] = REGION_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


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
