"""The operator's log lines name the object each is about, as `kopf run`'s do.

kopf attaches the object's reference to every record its per-object loggers emit (the
`k8s_ref` attribute); a plain format drops it, and "Handler 'release' failed temporarily"
then says nothing about which region waits.
"""

from __future__ import annotations

import copy
import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ObjectNamingFormatter(logging.Formatter):
    """Prefixes a record about an object with [namespace/name] (or [name], cluster-scoped)."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        name = ref.get("name") if isinstance(ref, dict) else None
        if name:
            namespace = ref.get("namespace") if isinstance(ref, dict) else None
            record = copy.copy(record)  # other handlers see the record as it was
            record.msg = (
                f"[{namespace}/{name}] {record.msg}" if namespace else f"[{name}] {record.msg}"
            )
        return super().format(record)


def configure_logging(level: str) -> None:
    """Root logging at `level` ("debug", "info", ...) to stderr, objects named."""
    handler = logging.StreamHandler()
    handler.setFormatter(ObjectNamingFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
