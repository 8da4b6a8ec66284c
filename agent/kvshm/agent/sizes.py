"""Byte counts for people: '1.5 GiB' out, '64Mi' / '1G' / '1048576' in."""

from __future__ import annotations

import re

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SUFFIXES = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]{0,2})\s*")


def format_bytes(count: float) -> str:
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """'64Mi', '1Gi', '500M', '4096': Kubernetes quantity suffixes (binary Ki..Ti, decimal k..T)."""
    match = _QUANTITY.fullmatch(text)
    suffix = match.group(2).lower() if match else ""
    if match is None or suffix not in _SUFFIXES:
        raise ValueError(
            f"{text!r} is not a byte count: use a number with an optional suffix Ki, Mi, Gi, Ti "
            f"(binary) or k, M, G, T (decimal), e.g. 512Mi"
        )
    return int(float(match.group(1)) * _SUFFIXES[suffix])
