"""The operator's log lines: each names the object it is about, and only failures are errors.

kopf attaches the object's reference to every record its per-object loggers emit (the
`k8s_ref` attribute); a plain format drops it, and "Handler 'release' failed temporarily"
then says nothing about which region waits. kopf logs every kopf.TemporaryError and
kopf.PermanentError at ERROR, but kvshm raises the first only to wait (a region waiting for
placement, a deletion waiting for the agents) and the second only for a spec it refuses (the
region's author is told by an Event and its conditions): those lines are shown at INFO and
WARNING, so alerts on the operator's ERROR lines see its own failures only.
"""

from __future__ import annotations

import copy
import logging
import re

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# kopf's lines for a TemporaryError that will be retried (not its "... but will time out"),
# and for a PermanentError
_WAITING = re.compile(r"Handler '[^']*' failed temporarily: ")
_REFUSED = re.compile(r"Handler '[^']*' failed permanently: ")


class ObjectNamingFormatter(logging.Formatter):
    """Prefixes a record about an object with [namespace/name] (or [name], cluster-scoped)."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            name, namespace = ref["name"], ref.get("namespace")
            record = copy.copy(record)  # other handlers see the record as it was
            record.msg = (
                f"[{namespace}/{name}] {record.msg}" if namespace else f"[{name}] {record.msg}"
            )
        return super().format(record)


class OnlyFailuresAreErrors(logging.Filter):
    """Shows kopf's retried TemporaryError lines at INFO and its PermanentError lines at WARNING
    instead of ERROR (and so not at all below `threshold`, the configured level)."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR:
            message = str(record.msg)
            level = (
                logging.INFO
                if _WAITING.match(message)
                else logging.WARNING
                if _REFUSED.match(message)
                else logging.ERROR
            )
            record.levelno, record.levelname = level, logging.getLevelName(level)
        return record.levelno >= self.threshold


def configure_logging(level: str) -> None:
    """Root logging at `level` ("debug", "info", ...) to stderr, objects named."""
    threshold = getattr(logging, level.upper())
    handler = logging.StreamHandler()
    handler.setFormatter(ObjectNamingFormatter(FORMAT))
    handler.addFilter(OnlyFailuresAreErrors(threshold))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(threshold)
