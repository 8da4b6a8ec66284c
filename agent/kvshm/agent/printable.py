"""Console and log output that never fails on what tenants named.

Tenant-chosen names reach the agent's messages; kvshm.api.messages.printable escapes what could
act on a terminal, and output is encoded with backslashreplace: printing never fails.
"""

from __future__ import annotations

import logging
from typing import TextIO

from kvshm.api.messages import printable


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
