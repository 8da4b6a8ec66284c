"""labelSelector and fieldSelector query parameters, as lists and watches filter with them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from tests.kube.errors import bad_request

Matcher = Callable[[Mapping[str, Any]], bool]

_SET_TERM = re.compile(r"^\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` is two terms."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


def _label_term(term: str) -> Callable[[Mapping[str, str]], bool]:
    set_match = _SET_TERM.match(term)
    if set_match:
        key, operator, values_text = set_match.groups()
        values = {v.strip() for v in values_text.split(",") if v.strip()}
        if operator == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for operator in ("!=", "==", "="):
        if operator in term:
            key, value = (part.strip() for part in term.split(operator, 1))
            if operator == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        return lambda labels: key not in labels
    if re.fullmatch(r"[^\s!=,()]+", term):
        return lambda labels: term in labels
    raise bad_request(f"unable to parse requirement: {term!r}")


def label_matcher(selector: str | None) -> Matcher:
    terms = [_label_term(term) for term in _split_terms(selector or "")]

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(term(labels) for term in terms)

    return matches


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return "" if node is None else str(node)


def field_matcher(selector: str | None) -> Matcher:
    """Equality terms on any dotted path (the API server allows a few per kind; tests need few)."""
    terms: list[tuple[str, str, bool]] = []
    for term in _split_terms(selector or ""):
        for operator in ("!=", "==", "="):
            if operator in term:
                path, value = (part.strip() for part in term.split(operator, 1))
                terms.append((path, value, operator != "!="))
                break
        else:
            raise bad_request(
                f"invalid field selector term {term!r}: use path=value or path!=value"
            )

    def matches(obj: Mapping[str, Any]) -> bool:
        return all((_field_value(obj, path) == value) == equal for path, value, equal in terms)

    return matches
