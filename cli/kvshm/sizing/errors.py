"""The one error kvshm's sizing raises (the input was not something it can size, and why), and
the check every integer it reads goes through."""

from __future__ import annotations

from kvshm.api.messages import bounded

QUOTED_CHARACTERS = 80  # of a refused value quoted in an error (a config value may be huge)


class SizingError(ValueError):
    """A model, parallelism or budget that kvshm cannot turn into a region layout."""


class UnsupportedModelError(SizingError):
    """The model's config.json describes a cache kvshm does not compute (it says which part)."""


def quoted(value: object) -> str:
    return bounded(repr(value), QUOTED_CHARACTERS)


def require_int(
    value: object, what: str, *, minimum: int = 1, error: type[SizingError] = SizingError
) -> int:
    """value, if it is an integer (JSON's true and false are not) of at least minimum; else
    `error` naming what, the value and what was expected."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise error(f"{what} must be {expected}, got {quoted(value)}")
    return value
