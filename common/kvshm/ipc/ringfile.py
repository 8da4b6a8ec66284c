"""The file a ring lives in: created or opened safely under a directory, mapped shared.

A ring in /dev/shm (the default) is what multiprocessing.shared_memory would make; a ring in a
region's directory is the same file elsewhere, so a pod that mounts that directory attaches by
path. Opens go through kvshm.region.safefile: relative to a directory descriptor, never
following a symlink, regular single-link files only.

Whoever else can write the directory may have written the file, so an attacher reads the trailer
with pread (nothing mapped yet), checks the geometry it names against the file's size, the
layout's bounds and the caller's own expectation (`accept`), and only then maps exactly that
many bytes, without MAP_POPULATE: populating a tmpfs mapping allocates every page, and the size
is not the attacher's choice. Only the creator, which sized and allocated the file itself,
populates its page tables up front.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from collections.abc import Callable

from kvshm.ipc.errors import RingConfigError, RingFormatError
from kvshm.ipc.layout import LINE, RingLayout
from kvshm.region import safefile
from kvshm.region.naming import INSTANCE_ID_PATTERN

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
DEFAULT_FILE_MODE = 0o600
_NAME_RE = re.compile(INSTANCE_ID_PATTERN)
MAX_NAME_LENGTH = 200


def random_name() -> str:
    return f"kvshm_ring_{secrets.token_hex(8)}"


def check_name(name: str) -> str:
    """A ring name becomes a file name: one safe path component, nothing else."""
    if (
        not isinstance(name, str)
        or len(name) > MAX_NAME_LENGTH
        or ".." in name
        or not _NAME_RE.fullmatch(name)
    ):
        raise RingConfigError(
            f"ring name {name!r} is not allowed: use up to {MAX_NAME_LENGTH} letters, digits, "
            f"'.', '_' and '-', starting with a letter or digit, without '..'"
        )
    return name


def check_ring_file_mode(file_mode: int) -> int:
    if not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777:
        raise RingConfigError(f"file mode {file_mode!r} is not a permission mode (0-0777)")
    if file_mode & 0o007:
        raise RingConfigError(
            f"file mode {file_mode:#o} lets every user on the node read or write the ring "
            f"(and so feed pickles to its readers); use owner and group bits only, e.g. 0600"
        )
    return file_mode


class RingFile:
    """One ring file, open read-write and mapped shared by this process."""

    def __init__(
        self, directory: str, name: str, dir_fd: int, fd: int, is_creator: bool, size: int
    ) -> None:
        self.directory = directory
        self.name = name
        self.is_creator = is_creator
        self._dir_fd = dir_fd
        self._fd = fd
        self.size = size
        # The creator chose the size and allocated it: MAP_POPULATE fills the page tables now,
        # so no message pays for first-touch faults. An attacher never populates (see above).
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if is_creator else 0)
        try:
            self.mapping = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except ValueError as exc:  # mmap's "length is greater than file size"
            raise RingFormatError(
                f"{self.path} shrank below the {size} bytes of its ring while being attached; "
                f"something other than kvshm is changing the file"
            ) from exc

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @classmethod
    def create(
        cls,
        directory: str,
        name: str,
        size: int,
        file_mode: int = DEFAULT_FILE_MODE,
        owner: tuple[int, int] | None = None,
    ) -> RingFile:
        """Create the file (exclusively), give it its size and pages, map it. Zero-filled."""
        check_ring_file_mode(file_mode)
        dir_fd = safefile.open_directory(directory)
        try:
            fd = safefile.create_exclusive(dir_fd, check_name(name), file_mode)
            if fd is None:
                raise FileExistsError(
                    errno.EEXIST,
                    f"{os.path.join(directory, name)} already exists: choose another ring name, "
                    f"resume its writer (MessageQueue.resume_writer), or remove the stale file",
                )
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            _allocate(fd, size, os.path.join(directory, name))
            return cls(directory, name, dir_fd, fd, is_creator=True, size=size)
        except BaseException:
            os.unlink(name, dir_fd=dir_fd)
            os.close(fd)
            os.close(dir_fd)
            raise

    @classmethod
    def open(
        cls, directory: str, name: str, accept: Callable[[RingLayout], bool] | None = None
    ) -> tuple[RingFile, RingLayout] | None:
        """Map an existing ring file and say its layout; None while its creator has not
        finished it (no trailer yet). FileNotFoundError if there is none; RingFormatError if
        its trailer is damaged, does not match its size, or names a layout `accept` refuses.
        Nothing is mapped before all of that is checked."""
        path = os.path.join(directory, name)
        dir_fd = safefile.open_directory(directory)
        fd = -1
        try:
            fd = safefile.open_existing(dir_fd, check_name(name), path)
            size = os.fstat(fd).st_size
            layout = (
                RingLayout.from_trailer(_read_trailer(fd, size, path), size, path)
                if size >= LINE
                else None
            )
            if layout is not None and accept is not None and not accept(layout):
                raise RingFormatError(
                    f"{path} is a ring of {layout.n_reader} readers and {layout.max_chunks} "
                    f"chunks of {layout.max_chunk_bytes} bytes, not one this process accepts; "
                    f"it was not mapped"
                )
        except BaseException:
            if fd >= 0:
                os.close(fd)
            os.close(dir_fd)
            raise
        if layout is None:
            os.close(fd)
            os.close(dir_fd)
            return None
        try:
            return cls(directory, name, dir_fd, fd, False, layout.total_bytes), layout
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            raise

    def rename(self, name: str) -> None:
        """Give the file another name in its directory, replacing whatever had that name (a
        symlink there is replaced, never followed)."""
        os.rename(self.name, check_name(name), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self.name = name

    def stat(self) -> os.stat_result:
        """The open file's own status (whatever its name refers to by now)."""
        return os.fstat(self._fd)

    def set_owner_and_mode(self, uid: int, gid: int, mode: int) -> None:
        """Owner and mode of the open file itself, never of whatever its name refers to."""
        check_ring_file_mode(mode)
        st = os.fstat(self._fd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(self._fd, uid, gid)
        if st.st_mode & 0o7777 != mode:
            os.fchmod(self._fd, mode)

    def reopen(self) -> int:
        """A new open file description of this same file (even if it was unlinked).

        Roles lock bytes through their own description, so two roles never share a lock, not
        even in one process or across fork.
        """
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        mine, other = os.fstat(self._fd), os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (other.st_dev, other.st_ino):
            os.close(fd)
            raise OSError(errno.EAGAIN, f"re-opening {self.path} gave another file; refused")
        return fd

    def unlink(self) -> None:
        """Remove the name, if it still names this file (never someone else's replacement)."""
        if safefile.is_same_file(self._dir_fd, self.name, self._fd):
            os.unlink(self.name, dir_fd=self._dir_fd)

    def close(self) -> None:
        try:
            self.mapping.close()
        except BufferError:
            # someone still holds a view of a chunk: the mapping goes when that view goes
            log.warning("ring %s: a chunk view is still in use; unmapping later", self.path)
        for fd in (self._fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dir_fd = -1


def _read_trailer(fd: int, size: int, path: str) -> bytes:
    """The last LINE bytes of a file found `size` bytes long, which may have shrunk since."""
    trailer = os.pread(fd, LINE, size - LINE)
    if len(trailer) < LINE:
        raise RingFormatError(
            f"{path} shrank from {size} bytes while its trailer was read; something other "
            f"than kvshm is changing the file"
        )
    return trailer


def _allocate(fd: int, size: int, path: str) -> None:
    """Size the file and allocate its pages now, so a full tmpfs fails here, not as SIGBUS."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise OSError(
            errno.ENOSPC,
            f"ring {path} needs {size} bytes but its filesystem has "
            f"{safefile.free_bytes(fd)} bytes free; use fewer or smaller chunks, or free or "
            f"enlarge the tmpfs",
        ) from exc
