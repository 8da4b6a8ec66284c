"""The files of one region, opened as vLLM opens them: O_CREAT|O_EXCL on file 0 picks the one
creator, which makes every other file with its size and sizes file 0 last; everyone else waits
for file 0 to reach its size, then opens and checks every other file. Closed again by
close(), where the creator may remove the files it made."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from enum import StrEnum

from kvshm.region import safefile
from kvshm.region.errors import (
    InvalidLayoutError,
    RegionAttachTimeout,
    RegionFileExistsError,
    RegionFileMissingError,
    RegionSizeMismatchError,
    RegionSpaceError,
)
from kvshm.region.layout import RegionFile

log = logging.getLogger(__name__)


class OpenMode(StrEnum):
    CREATE_OR_ATTACH = "create_or_attach"
    """vLLM's behaviour: the first process creates and sizes the file, the others attach."""
    ATTACH = "attach"
    """Never create: wait for the file someone else (the kvshm agent) creates."""
    CREATE = "create"
    """Always create; an existing file is an error."""


DEFAULT_FILE_MODE = 0o600  # the owner alone: a region is never world-readable


def check_file_mode(file_mode: int) -> int:
    if not 0 <= file_mode <= 0o777:
        raise InvalidLayoutError(f"file mode {file_mode:#o} is not a permission mode (0-0777)")
    if file_mode & 0o007:
        raise InvalidLayoutError(
            f"file mode {file_mode:#o} gives other users access to the KV cache; "
            f"use owner and group bits only (e.g. 0600 or 0660)"
        )
    return file_mode


class RegionFiles:
    """Descriptors of a region's files (file 0 first) in `directory`, opened relative to a
    descriptor of the directory. Attached processes hold a shared flock on file 0; with
    hold_every_file on every file, from the moment it is opened (or made) until close()."""

    def __init__(
        self,
        instance_id: str,
        files: list[RegionFile],
        directory: str,
        mode: OpenMode,
        file_mode: int,
        owner: tuple[int, int] | None,
        hold_every_file: bool = False,
    ) -> None:
        self.instance_id = instance_id
        self._hold_every_file = hold_every_file
        self.files = files
        self.directory = directory
        self.first_path = self.path(0)
        self.mode = mode
        self.is_creator = False
        self.fds = [-1] * len(files)
        self._file_mode = file_mode
        self._owner = owner
        self._created = [False] * len(files)
        self._dir_fd = safefile.open_directory(directory)

    @property
    def first_fd(self) -> int:
        return self.fds[0]

    def path(self, index: int) -> str:
        return os.path.join(self.directory, self.files[index].name)

    def open(self, size_bytes: int, timeout: float, poll_interval: float) -> None:
        """Create or attach as the mode says; size_bytes (all files) must be free to create."""
        deadline = time.monotonic() + timeout
        name = self.files[0].name
        while True:
            if self.mode is not OpenMode.ATTACH:
                fd = safefile.create_exclusive(self._dir_fd, name, self._file_mode)
                if fd is not None:
                    self.fds[0] = fd
                    self._created[0] = True
                    self.is_creator = True
                    self._initialise_created_files(size_bytes)
                    return
                if self.mode is OpenMode.CREATE:
                    raise FileExistsError(
                        errno.EEXIST,
                        f"{self.first_path} already exists and mode 'create' never attaches: "
                        f"use mode 'attach' or 'create_or_attach', or another instance id",
                    )
            try:
                self.fds[0] = safefile.open_existing(self._dir_fd, name, self.first_path)
            except FileNotFoundError:
                # attach: not created yet; create_or_attach: the creator gave up and removed it
                self._sleep_or_timeout(deadline, poll_interval, "did not appear in time")
                continue
            held = self._hold_shared()
            if held and safefile.is_same_file(self._dir_fd, name, self.first_fd):
                self._wait_for_size(deadline, poll_interval)
                self._open_other_files()
                return
            # locked for removal, or removed or replaced while we opened it: start over
            os.close(self.first_fd)
            self.fds[0] = -1
            if held:
                what = "was replaced while being opened until the attach timeout ran out"
                self._sleep_or_timeout(deadline, poll_interval, what)
            else:
                what = "was still locked exclusively (flock) when the attach timeout ran out"
                self._sleep_or_timeout(deadline, poll_interval, what, self._lock_advice())

    def _sleep_or_timeout(
        self, deadline: float, poll_interval: float, what: str, advice: str | None = None
    ) -> None:
        """Sleep a poll interval, or raise RegionAttachTimeout: file 0 `what`, and `advice`
        (by default: where the agent's region should be)."""
        if time.monotonic() >= deadline:
            raise RegionAttachTimeout(
                f"region file {self.first_path} {what}. {advice or self._placement_advice()}"
            )
        time.sleep(poll_interval)

    def _placement_advice(self) -> str:
        return (
            f"If the kvshm agent provides it, check that an OffloadRegion with instanceId "
            f"{self.instance_id!r} is placed on this node and Ready (kubectl get "
            f"offloadregions), and that its directory is mounted at {self.directory}."
        )

    def _lock_advice(self) -> str:
        return (
            f"The kvshm agent locks it so while it removes the region (its OffloadRegion "
            f"deleted or no longer placed on this node). Check that an OffloadRegion with "
            f"instanceId {self.instance_id!r} is placed on this node and Ready (kubectl get "
            f"offloadregions) and start again; if it is, another process holds the lock "
            f"(/proc/locks names its pid)."
        )

    def _hold_shared(self) -> bool:
        """Take a shared flock on file 0: attached processes are visible to the agent."""
        try:
            fcntl.flock(self.first_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # the agent holds it exclusively only while it removes the region
        return True

    def _initialise_created_files(self, size_bytes: int) -> None:
        fcntl.flock(self.first_fd, fcntl.LOCK_SH)
        if self._owner is not None:
            os.fchown(self.first_fd, *self._owner)
        free = safefile.free_bytes(self.first_fd)
        if free < size_bytes:
            raise RegionSpaceError(self.first_path, size_bytes, free, "checked before creating it")
        for index in range(1, len(self.files)):
            fd = safefile.create_exclusive(self._dir_fd, self.files[index].name, self._file_mode)
            if fd is None:
                raise RegionFileExistsError(self.path(index), self.first_path)
            self.fds[index] = fd
            self._created[index] = True
            self._hold(index)
            if self._owner is not None:
                os.fchown(fd, *self._owner)
            os.ftruncate(fd, self.files[index].length)
        # attachers wait for file 0 to reach its size, so it is sized last
        os.ftruncate(self.first_fd, self.files[0].length)

    def _wait_for_size(self, deadline: float, poll_interval: float) -> None:
        expected = self.files[0].length
        while True:
            actual = os.fstat(self.first_fd).st_size
            if actual == expected:
                return
            if actual != 0:
                raise RegionSizeMismatchError(self.first_path, actual, expected)
            self._sleep_or_timeout(
                deadline, poll_interval, f"did not reach {expected} bytes in time"
            )

    def _open_other_files(self) -> None:
        """File 0 has its size, so its creator has made every other file: open and check them."""
        for index in range(1, len(self.files)):
            path, expected = self.path(index), self.files[index].length
            try:
                fd = safefile.open_existing(self._dir_fd, self.files[index].name, path)
            except FileNotFoundError:
                raise RegionFileMissingError(path, expected) from None
            self.fds[index] = fd
            self._hold(index)
            actual = os.fstat(fd).st_size
            if actual != expected:
                raise RegionSizeMismatchError(path, actual, expected)

    def _hold(self, index: int) -> None:
        """With hold_every_file, a shared flock on file `index` (file 0 has one already): a
        process that removes the region files no one holds leaves it alone."""
        if not self._hold_every_file:
            return
        try:
            fcntl.flock(self.fds[index], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                "locked exclusively (flock) by another process, which may be removing it",
                self.path(index),
            ) from None

    def allocated_bytes(self) -> int:
        """Bytes the filesystem holds for the files."""
        return sum(os.fstat(fd).st_blocks * 512 for fd in self.fds)

    def close(self, unlink: bool) -> None:
        """Close every file; with unlink, a creator removes each file it created, only while
        the name still names that file (file 0 first, so no new attacher starts meanwhile).
        Idempotent."""
        for index, fd in enumerate(self.fds):
            if fd < 0:
                continue
            name = self.files[index].name
            if unlink and self._created[index] and safefile.is_same_file(self._dir_fd, name, fd):
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                except OSError as exc:
                    log.warning("could not remove %s: %s", self.path(index), exc)
            os.close(fd)
            self.fds[index] = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
