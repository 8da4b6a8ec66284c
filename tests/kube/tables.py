"""`kubectl get` tables: a CRD's additionalPrinterColumns evaluated on objects.

Only simple JSONPaths (`.a.b.c`) are evaluated, which is all the CRDs here use.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from tests.kube.resources import ResourceType


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def json_path(obj: Mapping[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.strip().lstrip(".").split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def _cell(column: Mapping[str, Any], obj: Mapping[str, Any]) -> Any:
    value = json_path(obj, column["jsonPath"])
    if column.get("type") == "date":
        return _age(value)
    return value


def table(rtype: ResourceType, items: list[dict[str, Any]]) -> dict[str, Any]:
    columns = list(rtype.printer_columns) or [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    ]
    definitions = [
        {"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}
    ]
    definitions += [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]
    rows = [
        {
            "cells": [obj["metadata"]["name"]] + [_cell(c, obj) for c in columns],
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            },
        }
        for obj in items
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {},
        "columnDefinitions": definitions,
        "rows": rows,
    }
