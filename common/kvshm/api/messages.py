"""Messages for status and Events, bounded by what the CRDs admit.

A status write with one string over its schema's maxLength is refused whole (422), so a region
whose message grew with its spec (hundreds of node names of up to 253 characters) would never
get a phase. Lists are summarised, and every message is cut to its field's bound.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence

# maxLength of OffloadRegion status.message and status.nodes.<node>.message (the CRD's)
MAX_STATUS_MESSAGE = 4096
# maxLength of a condition's message (metav1.Condition's)
MAX_CONDITION_MESSAGE = 32768
SHOWN = 3  # items a summary names
ELLIPSIS = "…"


def summarize(items: Sequence[str], noun: str = "nodes", shown: int = SHOWN) -> str:
    """'a', 'a and b', 'a, b and c', or '30 nodes: a, b, c and 27 more'."""
    if len(items) <= shown:
        if len(items) <= 1:
            return "".join(items)
        return f"{', '.join(items[:-1])} and {items[-1]}"
    return f"{len(items)} {noun}: {', '.join(items[:shown])} and {len(items) - shown} more"


# Cc controls (ESC, BEL, CR, ...), Cf format characters (bidi overrides, zero-width),
# Cs surrogates (os.listdir's stand-ins for bytes that are not UTF-8), Zl/Zp separators
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _escape(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the original byte
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` (a tenant's name or words) with every character that could act on a terminal, or
    is no character at all, written as a Python-style escape; ordinary text, accented letters
    included, unchanged. Such text then prints, logs and encodes as UTF-8 in a status: a lone
    surrogate would fail the API write, an escape sequence would rewrite `kubectl describe`."""
    if text.isprintable():
        return text
    return "".join(
        _escape(c) if c != " " and unicodedata.category(c) in _UNSAFE_CATEGORIES else c
        for c in text
    )


def bounded(text: str, limit: int = MAX_STATUS_MESSAGE) -> str:
    """text, cut to at most `limit` characters (ending in '…' when cut)."""
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS


def status_message(body: object) -> str | None:
    """The message of the Kubernetes Status an API error's body carries (bytes or text), or
    None when the body is no Status with a message."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    if not isinstance(text, str):
        return None
    try:
        status = json.loads(text)
    except ValueError:
        return None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else None


_BINARY_UNITS = ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki"))


def readable_bytes(count: int) -> str:
    """A byte count as people read it, in the largest binary unit it reaches: 8Gi exactly, or
    with one decimal when not whole (68718428160 is 64.0Gi); the status's Size column."""
    for unit, suffix in _BINARY_UNITS:
        if count >= unit:
            whole, rest = divmod(count, unit)
            return f"{whole}{suffix}" if rest == 0 else f"{count / unit:.1f}{suffix}"
    return f"{count}B"
