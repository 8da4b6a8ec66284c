"""Errors a user of a region can cause; each message says what was wrong and what to do."""

from __future__ import annotations

import errno


class RegionError(Exception):
    """Base class of every error kvshm.region raises on purpose."""


class InvalidLayoutError(RegionError, ValueError):
    """The block count, cpu page size or worker count cannot describe a region."""


class InvalidInstanceIdError(RegionError, ValueError):
    """An instance id that would not make a safe, single file name."""


class UnsafePathError(RegionError, OSError):
    """Something other than a plain regular file sits where a region file goes."""


class RegionSizeMismatchError(RegionError, OSError):
    """An existing region file has another size than the layout asks for; it is left untouched."""

    def __init__(self, path: str, actual_bytes: int, expected_bytes: int) -> None:
        super().__init__(
            f"region file {path} is {actual_bytes} bytes but the layout needs "
            f"{expected_bytes} bytes; it was left untouched. Another region with the same "
            f"instance id but a different layout exists: use a different instance id, or "
            f"remove the old region once nothing uses it."
        )
        self.path = path
        self.actual_bytes = actual_bytes
        self.expected_bytes = expected_bytes


class RegionResizedError(RegionSizeMismatchError):
    """A region file changed size while this process opened or populated it: another process
    (one the file's owner allows to write it) truncated or grew it meanwhile."""

    def __init__(self, path: str, actual_bytes: int, expected_bytes: int, when: str) -> None:
        OSError.__init__(
            self,
            errno.ESTALE,
            f"region file {path} changed size {when}: it is {actual_bytes} bytes, the layout "
            f"needs {expected_bytes}. Another process with write access truncated or grew it; "
            f"nothing may write the region's files but the region itself.",
        )
        self.path = path
        self.actual_bytes = actual_bytes
        self.expected_bytes = expected_bytes


class RegionFileMissingError(RegionSizeMismatchError):
    """File 0 of a segmented region exists but a later file of it does not; nothing is created."""

    def __init__(self, path: str, expected_bytes: int) -> None:
        OSError.__init__(
            self,
            errno.ENOENT,
            f"region file {path} ({expected_bytes} bytes) is missing although the region's "
            f"first file is there; nothing was created or changed. The region is incomplete "
            f"(someone removed a file): delete the region's files once nothing uses them, or "
            f"use a new instance id.",
        )
        self.path = path
        self.actual_bytes = 0
        self.expected_bytes = expected_bytes


class RegionExtraFileError(RegionSizeMismatchError):
    """A file of the region's instance id that its layout does not name (made for another one)."""

    def __init__(self, path: str, actual_bytes: int, file_count: int) -> None:
        OSError.__init__(
            self,
            errno.EEXIST,
            f"region file {path} ({actual_bytes} bytes) is not one of the {file_count} files the "
            f"layout names: the files on disk were made for another layout; they were left "
            f"untouched. Use a different instance id, or remove the old region's files once "
            f"nothing uses them.",
        )
        self.path = path
        self.actual_bytes = actual_bytes
        self.expected_bytes = 0


class RegionFileExistsError(RegionError, OSError):
    """A creator found a file already where one of its region's other files goes."""

    def __init__(self, path: str, first_file: str) -> None:
        super().__init__(
            errno.EEXIST,
            f"{path} already exists, left over from an earlier region with the same instance "
            f"id; it was left untouched and {first_file} was not completed. Remove the "
            f"leftover once nothing uses it (the kvshm agent lists it as an orphan), or use "
            f"another instance id.",
        )
        self.path = path


class RegionSpaceError(RegionError, OSError):
    """The filesystem holding the region cannot hold all of its pages."""

    def __init__(self, path: str, needed_bytes: int, free_bytes: int | None, detail: str) -> None:
        free = "unknown" if free_bytes is None else f"{free_bytes} bytes"
        super().__init__(
            errno.ENOSPC,
            f"region {path} needs {needed_bytes} bytes but its filesystem has {free} free "
            f"({detail}). Free memory on the tmpfs (remove unused regions), enlarge it "
            f"(mount -o remount,size=...), or ask for fewer blocks.",
        )
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class RegionLockError(RegionError, PermissionError):
    """mlock was refused: the process lacks CAP_IPC_LOCK or a large enough RLIMIT_MEMLOCK."""


class RegionAttachTimeout(RegionError, TimeoutError):
    """The region file did not appear, or did not reach its size, in time."""
