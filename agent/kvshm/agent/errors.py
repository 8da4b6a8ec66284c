"""The bounded set of error reasons the agent counts (kvshm_agent_errors_total{reason})."""

from __future__ import annotations

import errno
from enum import StrEnum

from kvshm.region import (
    RegionLockError,
    RegionSizeMismatchError,
    RegionSpaceError,
    UnsafePathError,
)


class ErrorReason(StrEnum):
    CAPACITY = "capacity"
    SIZE_MISMATCH = "size_mismatch"
    UNSAFE_PATH = "unsafe_path"
    PERMISSION = "permission"
    LOCK = "lock"
    POPULATE = "populate"
    IO = "io"
    SPEC = "spec"
    API = "api"
    DRAIN = "drain"
    RECLAIM = "reclaim"
    DESCRIPTORS = "descriptors"


def classify(exc: BaseException) -> ErrorReason:
    if isinstance(exc, RegionSizeMismatchError):
        return ErrorReason.SIZE_MISMATCH
    if isinstance(exc, UnsafePathError):
        return ErrorReason.UNSAFE_PATH
    if isinstance(exc, RegionSpaceError):
        # admission passed (capacity is checked before anything is created): the tmpfs filled
        # up under the populate, so the populate failed
        return ErrorReason.POPULATE
    if isinstance(exc, RegionLockError):
        return ErrorReason.LOCK
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EPERM:
        return ErrorReason.PERMISSION
    return ErrorReason.IO


def describe(exc: BaseException) -> str:
    """An error's message without Python's "[Errno N]" prefix, naming the file if it has one."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)
