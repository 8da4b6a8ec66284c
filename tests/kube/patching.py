"""The three patch formats the API server takes: JSON merge, JSON (RFC 6902), strategic merge."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Fields of built-in kinds whose lists merge by a key under a strategic merge patch
# (the patchMergeKey of the Kubernetes Go types that tests here touch).
_MERGE_KEYS = {"conditions": "type", "addresses": "type", "containers": "name", "env": "name"}
# Lists of scalars whose strategic merge is a union (patchStrategy: merge).
_UNION_LISTS = {"finalizers"}


class PatchError(ValueError):
    """A patch that cannot be applied; the API server answers 422 (or 400 for a malformed one)."""


class MalformedPatchError(PatchError):
    pass


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes' strategic merge, for the fields listed above; other lists are replaced.

    Supports `$patch: delete` on list items with a merge key; other directives are refused.
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise MalformedPatchError(f"strategic merge directive {key!r} is not emulated")
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in _MERGE_KEYS:
            result[key] = _merge_keyed_list(result.get(key) or [], value, _MERGE_KEYS[key])
        elif isinstance(value, list) and key in _UNION_LISTS:
            old = list(result.get(key) or [])
            result[key] = old + [item for item in value if item not in old]
        else:
            result[key] = strategic_merge_patch(result.get(key), value, key)
    return result


def _merge_keyed_list(target: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, Mapping) or merge_key not in item:
            raise MalformedPatchError(f"list item {item!r} lacks its merge key {merge_key!r}")
        index = next(
            (i for i, old in enumerate(result) if old.get(merge_key) == item[merge_key]), None
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(copy.deepcopy(dict(item)))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 on a copy of target; a failed `test` or a missing path raises PatchError."""
    if not isinstance(operations, list):
        raise MalformedPatchError("a JSON patch must be a list of operations")
    document = copy.deepcopy(target)
    for operation in operations:
        if not isinstance(operation, Mapping) or "op" not in operation or "path" not in operation:
            raise MalformedPatchError(f"JSON patch operation {operation!r} needs 'op' and 'path'")
        document = _apply_operation(document, operation)
    return document


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise MalformedPatchError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(document: Any, tokens: list[str], path: str) -> Any:
    node = document
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise PatchError(f"missing path {path!r}: no key {token!r}")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, path, allow_end=False)]
    raise PatchError(f"missing path {path!r}: {token!r} is inside a scalar")


def _index(node: list[Any], token: str, path: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"path {path!r}: {token!r} is not an array index")
    index = int(token)
    if index > len(node) or (index == len(node) and not allow_end):
        raise PatchError(f"path {path!r}: index {index} is out of range")
    return index


def _get(document: Any, path: str) -> Any:
    node = document
    for token in _pointer(path):
        node = _child(node, token, path)
    return node


def _remove(document: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        return None, document
    parent = _parent(document, tokens, path)
    if isinstance(parent, dict):
        if tokens[-1] not in parent:
            raise PatchError(f"cannot remove {path!r}: it does not exist")
        return document, parent.pop(tokens[-1])
    if isinstance(parent, list):
        return document, parent.pop(_index(parent, tokens[-1], path, allow_end=False))
    raise PatchError(f"cannot remove {path!r}: its parent is a scalar")


def _add(document: Any, path: str, value: Any, *, replace: bool) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return copy.deepcopy(value)
    parent = _parent(document, tokens, path)
    if isinstance(parent, dict):
        if replace and tokens[-1] not in parent:
            raise PatchError(f"cannot replace {path!r}: it does not exist")
        parent[tokens[-1]] = copy.deepcopy(value)
    elif isinstance(parent, list):
        index = _index(parent, tokens[-1], path, allow_end=not replace)
        if replace:
            parent[index] = copy.deepcopy(value)
        else:
            parent.insert(index, copy.deepcopy(value))
    else:
        raise PatchError(f"cannot set {path!r}: its parent is a scalar")
    return document


def _apply_operation(document: Any, operation: Mapping[str, Any]) -> Any:
    op, path = operation["op"], operation["path"]
    if op in ("add", "replace", "test") and "value" not in operation:
        raise MalformedPatchError(f"JSON patch {op!r} at {path!r} needs a 'value'")
    if op == "add":
        return _add(document, path, operation["value"], replace=False)
    if op == "replace":
        return _add(document, path, operation["value"], replace=True)
    if op == "remove":
        return _remove(document, path)[0]
    if op == "test":
        actual = _get(document, path)
        if actual != operation["value"]:
            raise PatchError(
                f"testing value {path} failed: expected {operation['value']!r}, found {actual!r}"
            )
        return document
    if op in ("move", "copy"):
        source = operation.get("from")
        if not isinstance(source, str):
            raise MalformedPatchError(f"JSON patch {op!r} needs a 'from' pointer")
        if op == "move":
            document, value = _remove(document, source)
        else:
            value = _get(document, source)
        return _add(document, path, value, replace=False)
    raise MalformedPatchError(f"unknown JSON patch operation {op!r}")
