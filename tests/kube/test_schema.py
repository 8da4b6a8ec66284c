"""Structural-schema handling on small schemas: the parts the kvshm CRDs use lightly or not yet."""

from __future__ import annotations

from typing import Any

from tests.kube import schema

OBJECT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "size": {"type": "integer", "default": 1},
                "port": {"x-kubernetes-int-or-string": True},
                "note": {"type": "string", "nullable": True},
                "items": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                    },
                },
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
            "x-kubernetes-validations": [
                {
                    "rule": "self.size < 10",
                    "messageExpression": "'size ' + string(self.size) + ' is 10 or more'",
                },
                {"rule": "self.size != 5", "message": "not five", "fieldPath": ".size"},
                {"rule": "self.size >= oldSelf.size", "message": "size may only grow"},
            ],
        }
    },
}


def obj(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "a"}, "spec": spec}


def messages(causes: list[Any]) -> list[str]:
    return [f"{c.field}: {c.message}" for c in causes]


def test_defaults_pruning_and_preserved_fields() -> None:
    prepared, pruned = schema.prepare(obj(extra=1, free={"any": {"thing": 1}}, note=None), OBJECT)
    assert prepared["spec"] == {"size": 1, "free": {"any": {"thing": 1}}, "note": None}
    assert pruned == ["spec.extra"]
    assert prepared["metadata"] == {"name": "a"}


def test_int_or_string_and_nullable() -> None:
    for port in (80, "http"):
        assert schema.validate(schema.prepare(obj(port=port), OBJECT)[0], OBJECT, None) == []
    bad = schema.validate(schema.prepare(obj(port=1.5), OBJECT)[0], OBJECT, None)
    assert messages(bad) == [
        "spec.port: Invalid value: 1.5: spec.port in body must be of type int-or-string"
    ]


def test_list_maps_are_unique_by_key() -> None:
    items = [{"name": "a", "n": 1}, {"name": "a", "n": 2}]
    causes = schema.validate(obj(items=items, size=1), OBJECT, None)
    assert messages(causes) == ['spec.items[1]: Duplicate value: ["a"]']


def test_message_expression_and_field_path() -> None:
    assert messages(schema.validate(obj(size=12), OBJECT, None)) == [
        'spec: Invalid value: "object": size 12 is 10 or more'
    ]
    assert messages(schema.validate(obj(size=5), OBJECT, None)) == [
        'spec.size: Invalid value: "object": not five'
    ]


def test_transition_rules_run_on_updates_only() -> None:
    assert schema.validate(obj(size=3), OBJECT, None) == []
    assert schema.validate(obj(size=3), OBJECT, obj(size=2)) == []
    assert "size may only grow" in messages(schema.validate(obj(size=1), OBJECT, obj(size=2)))[0]


def test_rules_do_not_run_on_badly_typed_objects() -> None:
    causes = schema.validate(obj(size="big"), OBJECT, None)
    assert messages(causes) == [
        'spec.size: Invalid value: "string": spec.size in body must be of type integer: "string"'
    ]
