"""Structural-schema handling of custom resources, in the API server's order.

prune unknown fields -> apply defaults -> validate types and bounds -> x-kubernetes-validations.
Messages follow the API server's wording so tests (and users reading them) see what kubectl shows.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import re
from collections.abc import Mapping
from typing import Any

from tests.kube import cel
from tests.kube.errors import Cause

Schema = Mapping[str, Any]
INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_ROOT_KEYS = ("apiVersion", "kind", "metadata")


def prepare(obj: dict[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """A copy of obj with unknown fields pruned and defaults applied (metadata left alone),
    and the paths of the fields it pruned."""
    result = copy.deepcopy(obj)
    body = {k: v for k, v in result.items() if k not in _ROOT_KEYS}
    pruned: list[str] = []
    body = _prune_and_default(body, _body_schema(schema), "", pruned)
    return {**{k: result[k] for k in _ROOT_KEYS if k in result}, **body}, pruned


def validate(obj: Mapping[str, Any], schema: Schema, old: Mapping[str, Any] | None) -> list[Cause]:
    """Every violation of schema by obj (an already prepared object); [] when valid."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEYS}
    causes = _validate(body, _body_schema(schema), "")
    # the rules of a node whose own subtree is invalid would only fail on the same problem
    invalid_paths = {cause.field for cause in causes}
    root_view = {**body, "metadata": _cel_metadata(obj)}
    old_body = None if old is None else {k: v for k, v in old.items() if k not in _ROOT_KEYS}
    old_view = None if old is None else {**(old_body or {}), "metadata": _cel_metadata(old)}
    return causes + _run_rules(root_view, schema, old_view, "", invalid_paths)


def _is_within(path: str, node: str) -> bool:
    return not node or path == node or path.startswith((node + ".", node + "["))


def _body_schema(schema: Schema) -> Schema:
    properties = {k: v for k, v in schema.get("properties", {}).items() if k not in _ROOT_KEYS}
    return {**schema, "properties": properties, "x-kubernetes-validations": []}


def _cel_metadata(obj: Mapping[str, Any]) -> dict[str, Any]:
    # Rules at the root see only these two fields of metadata, as in the API server.
    meta = obj.get("metadata") or {}
    return {k: meta[k] for k in ("name", "generateName") if k in meta}


def _prune_and_default(value: Any, schema: Schema, path: str, pruned: list[str]) -> Any:
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        return _object_prune_and_default(value, schema, path, pruned)
    if isinstance(value, list) and "items" in schema:
        items = enumerate(value)
        return [_prune_and_default(v, schema["items"], f"{path}[{i}]", pruned) for i, v in items]
    return value


def _object_prune_and_default(
    value: dict[str, Any], schema: Schema, path: str, pruned: list[str]
) -> dict[str, Any]:
    properties: Mapping[str, Schema] = schema.get("properties", {})
    additional = schema.get("additionalProperties")
    keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False)
    result: dict[str, Any] = {}
    for key, item in value.items():
        sub = properties.get(key) if properties else None
        if sub is None and isinstance(additional, Mapping):
            sub = additional
        if sub is None:
            if keep_unknown or (additional is True):
                result[key] = item
            else:
                pruned.append(_join(path, key))  # dropped, as the API server does
            continue
        if item is None and not sub.get("nullable", False):
            continue  # null of a non-nullable field is pruned, so its default applies
        child = _join(path, key) if key in properties else f"{path}[{key}]"
        result[key] = _prune_and_default(item, sub, child, pruned)
    for key, sub in properties.items():
        if key not in result and "default" in sub:
            result[key] = _prune_and_default(copy.deepcopy(sub["default"]), sub, path, pruned)
    return result


def _show(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# bool before int: in Python a bool is an int, in JSON it is not
_TYPE_NAMES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _type_name(value: Any) -> str:
    return next((name for kind, name in _TYPE_NAMES if isinstance(value, kind)), "null")


def _type_matches(value: Any, expected: str) -> bool:
    actual = _type_name(value)
    return actual == expected or (expected == "number" and actual == "integer")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _validate(value: Any, schema: Schema, path: str) -> list[Cause]:
    expected = schema.get("type")
    if value is None:
        if schema.get("nullable", False):
            return []
        return [
            Cause(
                path,
                "FieldValueInvalid",
                f'Invalid value: "null": {path} in body must be of type {expected}: "null"',
            )
        ]
    if schema.get("x-kubernetes-int-or-string"):
        if not (_type_matches(value, "integer") or _type_matches(value, "string")):
            return [_invalid(path, value, f"{path} in body must be of type int-or-string")]
    elif expected and not _type_matches(value, expected):
        actual = _type_name(value)
        message = (
            f'Invalid value: "{actual}": {path} in body must be of type {expected}: "{actual}"'
        )
        return [Cause(path, "FieldValueTypeInvalid", message)]
    causes = _scalar_causes(value, schema, path)
    if isinstance(value, dict):
        causes += _object_causes(value, schema, path)
    elif isinstance(value, list):
        causes += _array_causes(value, schema, path)
    return causes


def _invalid(path: str, value: Any, why: str) -> Cause:
    return Cause(path, "FieldValueInvalid", f"Invalid value: {_show(value)}: {why}")


def _scalar_causes(value: Any, schema: Schema, path: str) -> list[Cause]:
    causes: list[Cause] = []
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_show(v) for v in schema["enum"])
        causes.append(
            Cause(
                path,
                "FieldValueNotSupported",
                f"Unsupported value: {_show(value)}: supported values: {supported}",
            )
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        causes += _number_causes(value, schema, path)
    if isinstance(value, str):
        causes += _string_causes(value, schema, path)
    return causes


def _number_causes(value: float, schema: Schema, path: str) -> list[Cause]:
    causes = []
    bounds = INT_BOUNDS.get(
        schema.get("format", "int64" if schema.get("type") == "integer" else "")
    )
    if bounds and isinstance(value, int) and not bounds[0] <= value <= bounds[1]:
        causes.append(
            _invalid(path, value, f"{path} in body must fit in {schema.get('format', 'int64')}")
        )
    if "minimum" in schema:
        exclusive = schema.get("exclusiveMinimum", False)
        if value < schema["minimum"] or (exclusive and value == schema["minimum"]):
            words = "greater than" if exclusive else "greater than or equal to"
            causes.append(
                _invalid(path, value, f"{path} in body should be {words} {schema['minimum']}")
            )
    if "maximum" in schema:
        exclusive = schema.get("exclusiveMaximum", False)
        if value > schema["maximum"] or (exclusive and value == schema["maximum"]):
            words = "less than" if exclusive else "less than or equal to"
            causes.append(
                _invalid(path, value, f"{path} in body should be {words} {schema['maximum']}")
            )
    return causes


def _string_causes(value: str, schema: Schema, path: str) -> list[Cause]:
    causes = []
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        causes.append(
            Cause(
                path,
                "FieldValueTooLong",
                f"Too long: may not be more than {schema['maxLength']} bytes",
            )
        )
    if "minLength" in schema and len(value) < schema["minLength"]:
        causes.append(
            _invalid(
                path, value, f"{path} in body should be at least {schema['minLength']} chars long"
            )
        )
    if "pattern" in schema and not re.search(schema["pattern"], value):
        causes.append(_invalid(path, value, f"{path} in body should match '{schema['pattern']}'"))
    if schema.get("format") == "date-time" and not _is_date_time(value):
        causes.append(
            _invalid(path, value, f"{path} in body must be of type date-time: {_show(value)}")
        )
    return causes


def _is_date_time(value: str) -> bool:
    try:
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return "T" in value or " " in value


def _object_causes(value: dict[str, Any], schema: Schema, path: str) -> list[Cause]:
    causes = [
        Cause(_join(path, key), "FieldValueRequired", "Required value")
        for key in schema.get("required", ())
        if key not in value
    ]
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        causes.append(
            Cause(
                path,
                "FieldValueTooMany",
                f"Too many: {len(value)}: must have at most {schema['maxProperties']} items",
            )
        )
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        causes.append(
            _invalid(
                path,
                len(value),
                f"{path} in body should have at least {schema['minProperties']} properties",
            )
        )
    properties: Mapping[str, Schema] = schema.get("properties", {})
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        if key in properties:
            causes += _validate(item, properties[key], _join(path, key))
        elif isinstance(additional, Mapping):
            causes += _validate(item, additional, f"{path}[{key}]")
    return causes


def _array_causes(value: list[Any], schema: Schema, path: str) -> list[Cause]:
    causes = []
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        causes.append(
            Cause(
                path,
                "FieldValueTooMany",
                f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
            )
        )
    if "minItems" in schema and len(value) < schema["minItems"]:
        causes.append(
            _invalid(
                path, len(value), f"{path} in body should have at least {schema['minItems']} items"
            )
        )
    causes += _list_type_causes(value, schema, path)
    item_schema = schema.get("items")
    if isinstance(item_schema, Mapping):
        for index, item in enumerate(value):
            causes += _validate(item, item_schema, f"{path}[{index}]")
    return causes


def _list_type_causes(value: list[Any], schema: Schema, path: str) -> list[Cause]:
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "set":
        keys = [_show(item) for item in value]
    elif list_type == "map":
        names = schema.get("x-kubernetes-list-map-keys", [])
        keys = [
            _show([item.get(n) for n in names]) if isinstance(item, dict) else _show(item)
            for item in value
        ]
    else:
        return []
    seen: set[str] = set()
    causes = []
    for index, key in enumerate(keys):
        if key in seen:
            causes.append(
                Cause(f"{path}[{index}]", "FieldValueDuplicate", f"Duplicate value: {key}")
            )
        seen.add(key)
    return causes


def _run_rules(value: Any, schema: Schema, old: Any, path: str, invalid: set[str]) -> list[Cause]:
    """x-kubernetes-validations of this node (if its subtree is valid), then of its children."""
    own_rules = schema.get("x-kubernetes-validations", ())
    if any(_is_within(bad, path) for bad in invalid):
        own_rules = ()
    causes = [cause for rule in own_rules for cause in _run_rule(rule, value, old, path)]
    if isinstance(value, dict):
        properties: Mapping[str, Schema] = schema.get("properties", {})
        additional = schema.get("additionalProperties")
        old_map = old if isinstance(old, dict) else {}
        for key, item in value.items():
            sub = properties.get(key) or (additional if isinstance(additional, Mapping) else None)
            if sub is not None and key != "metadata":
                child = _join(path, key) if key in properties else f"{path}[{key}]"
                causes += _run_rules(item, sub, old_map.get(key), child, invalid)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            # old items are correlated only for map lists in the API server; none here need it
            causes += _run_rules(item, schema["items"], None, f"{path}[{index}]", invalid)
    return causes


def _run_rule(rule: Mapping[str, Any], value: Any, old: Any, path: str) -> list[Cause]:
    expression = rule["rule"]
    if cel.is_transition_rule(expression) and old is None:
        return []
    field = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
    try:
        passed = cel.check(expression, value, old)
    except cel.CelRuleError as exc:
        return [_invalid(field, _type_name(value), f"{exc}")]
    if passed:
        return []
    message = rule.get("message") or f"failed rule: {expression}"
    if "messageExpression" in rule:
        # on an error the API server falls back to message as well
        with contextlib.suppress(cel.CelRuleError):
            message = str(cel.evaluate(rule["messageExpression"], value, old))
    reason = {
        "FieldValueRequired": "FieldValueRequired",
        "FieldValueDuplicate": "FieldValueDuplicate",
        "FieldValueForbidden": "FieldValueForbidden",
    }.get(rule.get("reason", ""), "FieldValueInvalid")
    return [
        Cause(field.lstrip("."), reason, f"Invalid value: {_show(_type_name(value))}: {message}")
    ]
