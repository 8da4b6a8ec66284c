"""Opening region files without trusting the directory they sit in.

Every open is relative to a directory file descriptor, never follows a symlink, never opens
anything but a regular file with a single link, and checks the inode it got is the one it
looked at (a file swapped in between is refused, not used).

"Never opens" is literal: an existing name is first taken with O_PATH (which opens nothing: a
FIFO's other end sees no reader, a device's driver is not called), the inode is checked through
that handle, and only that same inode is then opened, through /proc/self/fd. A FIFO swapped in
between a check and an open cannot be opened, because nothing is looked up by name twice.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from kvshm.region.errors import UnsafePathError

_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC


def open_directory(path: str, *, follow_symlinks: bool = True) -> int:
    """A descriptor of the directory a caller named (the caller trusts its own path); without
    follow_symlinks a symlink at its last component is refused (ELOOP), as for a path someone
    else may have planted."""
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)


def describe_file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "an unknown kind of file"


def check_regular(st: os.stat_result, path: str) -> None:
    """Refuse anything but a regular file with exactly one link."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(
            errno.EPERM,
            f"{path} is {describe_file_type(st.st_mode)}, not a region file; it was not "
            f"opened or changed. Remove it, or use another instance id.",
        )
    if st.st_nlink != 1:
        raise UnsafePathError(
            errno.EPERM,
            f"{path} has {st.st_nlink} hard links; a region file has exactly one. It was not "
            f"opened or changed. Remove the extra links (or the file) first.",
        )


def create_exclusive(dir_fd: int, name: str, mode: int) -> int | None:
    """Create `name` as a new empty file; None if anything already has that name.

    O_EXCL makes exactly one racing process the creator, and with O_CREAT it never follows a
    symlink planted at the name.
    """
    try:
        fd = os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
    except FileExistsError:
        return None
    os.fchmod(fd, mode)  # the umask must not decide a region's permissions
    return fd


def open_checked(
    name: str,
    flags: int,
    path: str,
    dir_fd: int | None = None,
    check: Callable[[os.stat_result, str], None] = check_regular,
    follow_symlinks: bool = False,
) -> int:
    """Open `name` (relative to dir_fd) with `flags` only if `check` accepts the inode, which is
    looked up once, with O_PATH (and O_NOFOLLOW unless follow_symlinks: only for names the
    caller trusts), and checked before it is opened. FileNotFoundError if there is none."""
    lookup = os.O_PATH | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    handle = os.open(name, lookup, dir_fd=dir_fd)
    try:
        before = os.fstat(handle)
        check(before, path)  # a symlink is the link itself here: refused, never followed
        # the magic link names the very inode the handle holds, whatever the name is by now
        fd = os.open(f"/proc/self/fd/{handle}", flags | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(handle)
    try:
        after = os.fstat(fd)
        check(after, path)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafePathError(errno.EAGAIN, f"{path} was replaced while being opened; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_existing(dir_fd: int, name: str, path: str) -> int:
    """Open an existing regular single-link file read-write. FileNotFoundError if there is
    none."""
    return open_checked(name, os.O_RDWR, path, dir_fd)


def is_same_file(dir_fd: int, name: str, fd: int) -> bool:
    """Whether `name` in the directory still names the file open as `fd`."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer can still allocate on fd's filesystem."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize
