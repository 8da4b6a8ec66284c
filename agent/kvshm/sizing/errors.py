"""The one error kvshm's sizing raises: the input was not something it can size, and why."""

from __future__ import annotations


class SizingError(ValueError):
    """A model, parallelism or budget that kvshm cannot turn into a region layout."""


class UnsupportedModelError(SizingError):
    """The model's config.json describes a cache kvshm does not compute (it says which part)."""
