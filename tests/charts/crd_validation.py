"""Validate custom resources against a CRD's openAPIV3Schema, strictly (like kubectl's
--validate=strict): an unknown field is an error unless the schema preserves unknown fields."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema

from tests.charts.rendering import load_yaml_documents


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 (as Kubernetes uses it) to a JSON Schema that rejects unknown fields."""
    schema = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        if node.get("nullable"):
            kind = node.get("type")
            if isinstance(kind, str):
                node["type"] = [kind, "null"]
        closed = not node.get("x-kubernetes-preserve-unknown-fields")
        if closed and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                visit(child)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                visit(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, []):
                visit(child)

    visit(schema)
    # metadata is checked by the API server itself, not by the CRD's schema
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return schema


class CrdSchemas:
    """Validators by (apiVersion, kind) for every served version of the given CRDs."""

    def __init__(self, crd_files: Iterable[Path]) -> None:
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        for path in crd_files:
            for crd in load_yaml_documents(path):
                assert crd["kind"] == "CustomResourceDefinition", f"{path} holds a {crd['kind']}"
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for version in crd["spec"]["versions"]:
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    validator = jsonschema.Draft4Validator(schema)
                    self._validators[(f"{group}/{version['name']}", kind)] = validator

    def kinds(self) -> set[tuple[str, str]]:
        return set(self._validators)

    def errors(self, resource: dict[str, Any]) -> list[str]:
        """What is wrong with the resource; empty when it is valid."""
        key = (resource.get("apiVersion", ""), resource.get("kind", ""))
        validator = self._validators.get(key)
        if validator is None:
            return [f"no CRD serves {key[0]} {key[1]}"]
        return [
            f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
            for error in validator.iter_errors(resource)
        ]
