"""CEL rules of x-kubernetes-validations, evaluated with cel-python (a real CEL implementation).

The API server's CEL environment has more libraries (quantity, url, ...) than cel-python;
the rules in this project's CRDs use only the standard macros and string functions, and the
tests in tests/api evaluate every rule of every CRD here, so a rule cel-python cannot run fails
loudly instead of being skipped.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import celpy

# cel-python logs every evaluation step at DEBUG: drowns kopf's --verbose output
logging.getLogger("celpy").setLevel(logging.WARNING)
_ENV = celpy.Environment()


class CelRuleError(ValueError):
    """A rule that does not compile, or that does not evaluate to a bool."""


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> celpy.Runner:
    try:
        return _ENV.program(_ENV.compile(expression))
    except celpy.CELParseError as exc:
        raise CelRuleError(f"CEL expression {expression!r} does not compile: {exc}") from exc


def compile_rule(expression: str) -> None:
    """Raise CelRuleError if the expression does not compile."""
    _program(expression)


def is_transition_rule(expression: str) -> bool:
    """Rules that mention oldSelf run only on updates, when the old value exists."""
    return "oldSelf" in expression


def evaluate(expression: str, value: Any, old_value: Any = None) -> Any:
    """The result of expression with `self` (and `oldSelf`) bound; raises CelRuleError on error."""
    activation = {"self": celpy.json_to_cel(value)}
    if old_value is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_value)
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELEvalError as exc:
        raise CelRuleError(f"evaluation error: {exc.args[0] if exc.args else exc}") from exc
    if isinstance(result, celpy.CELEvalError):
        raise CelRuleError(f"evaluation error: {result.args[0] if result.args else result}")
    return result


def check(expression: str, value: Any, old_value: Any = None) -> bool:
    result = evaluate(expression, value, old_value)
    if not isinstance(result, celpy.celtypes.BoolType):
        raise CelRuleError(f"rule {expression!r} gave {result!r}, not a bool")
    return bool(result)
