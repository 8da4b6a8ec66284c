"""Text from tenants (file names in their directories) made safe to print and to log.

A tenant chooses the names in its region directory, and some reach the agent's messages (what a
drain left behind, unsafe entries under the root). Raw, an escape sequence in a name rewrites
the operator's terminal or log viewer, and a name that is not UTF-8 (or not encodable in the
console's encoding) made a pass fail while printing. So every control, format (bidi) and
separator character and every undecodable byte is written as a Python-style escape, and output
is encoded with backslashreplace: printing never fails.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import TextIO

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
    """`text` with every character that could act on a terminal (or is no character at all)
    escaped; ordinary text, accented letters included, unchanged."""
    if text.isprintable():
        return text
    return "".join(
        _escape(c) if c != " " and unicodedata.category(c) in _UNSAFE_CATEGORIES else c
        for c in text
    )


def encodable(text: str, stream: TextIO) -> str:
    """`text` as the stream can encode it (backslash escapes for what it cannot)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text.encode("ascii", "backslashreplace").decode("ascii")


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines are printable (see printable()), tracebacks included."""

    def format(self, record: logging.LogRecord) -> str:
        lines = super().format(record).split("\n")
        return "\n".join(printable(line) for line in lines)
