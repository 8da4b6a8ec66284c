"""Opening region files without trusting the directory they sit in.

Every open is relative to a directory file descriptor, never follows a symlink, never opens
anything but a regular file with a single link, and checks the inode it got is the one it
looked at (a file swapped in between is refused, not used).
"""

from __future__ import annotations

import errno
import os
import stat

from kvshm.region.errors import UnsafePathError

_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC


def open_directory(path: str) -> int:
    """A descriptor of the directory a caller named (the caller trusts its own path)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


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


def open_existing(dir_fd: int, name: str, path: str) -> int:
    """Open an existing regular file read-write. FileNotFoundError if there is none."""
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    check_regular(before, path)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                errno.ELOOP, f"{path} became a symbolic link while being opened; refused"
            ) from exc
        raise
    try:
        after = os.fstat(fd)
        check_regular(after, path)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafePathError(errno.EAGAIN, f"{path} was replaced while being opened; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


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
