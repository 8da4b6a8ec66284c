"""The patch formats on plain documents."""

from __future__ import annotations

import pytest

from tests.kube import patching


def test_merge_patch_merges_objects_removes_nulls_replaces_lists() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert patching.merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3]}) == {
        "a": {"c": 2, "d": 3},
        "l": [3],
    }
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2]}  # the original is untouched


def test_json_patch_operations() -> None:
    document = {"a": [1, 2], "b": {"c~/d": 1}}
    patched = patching.json_patch(
        document,
        [
            {"op": "add", "path": "/a/-", "value": 3},
            {"op": "add", "path": "/a/0", "value": 0},
            {"op": "remove", "path": "/a/1"},
            {"op": "replace", "path": "/b/c~0~1d", "value": 2},
            {"op": "copy", "from": "/b", "path": "/e"},
            {"op": "move", "from": "/e/c~0~1d", "path": "/f"},
            {"op": "test", "path": "/a", "value": [0, 2, 3]},
        ],
    )
    assert patched == {"a": [0, 2, 3], "b": {"c~/d": 2}, "e": {}, "f": 2}
    assert document == {"a": [1, 2], "b": {"c~/d": 1}}


@pytest.mark.parametrize(
    "operation",
    [
        {"op": "test", "path": "/a", "value": 2},
        {"op": "remove", "path": "/missing"},
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "add", "path": "/x/y", "value": 1},
        {"op": "add", "path": "/l/5", "value": 1},
    ],
)
def test_json_patch_failures_change_nothing(operation: dict[str, object]) -> None:
    with pytest.raises(patching.PatchError):
        patching.json_patch({"a": 1, "l": []}, [operation])


@pytest.mark.parametrize(
    "operations",
    [{"op": "add"}, [{"op": "jump", "path": "/a"}], [{"op": "add", "path": "a", "value": 1}]],
)
def test_malformed_json_patches(operations: object) -> None:
    with pytest.raises(patching.MalformedPatchError):
        patching.json_patch({}, operations)


def test_strategic_merge_patch_keys_lists_and_unions_finalizers() -> None:
    target = {
        "metadata": {"finalizers": ["a"]},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "Old", "status": "x"}]
        },
        "spec": {"taints": [{"key": "k"}]},
    }
    patched = patching.strategic_merge_patch(
        target,
        {
            "metadata": {"finalizers": ["b", "a"]},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False"},
                    {"type": "Old", "$patch": "delete"},
                    {"type": "New", "status": "True"},
                ]
            },
            "spec": {"taints": []},
        },
    )
    assert patched == {
        "metadata": {"finalizers": ["a", "b"]},
        "status": {
            "conditions": [{"type": "Ready", "status": "False"}, {"type": "New", "status": "True"}]
        },
        "spec": {"taints": []},
    }
