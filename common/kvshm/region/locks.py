"""Liveness through open-file-description byte locks (Linux F_OFD_SETLK / F_OFD_GETLK).

A process that holds a role (a ring's writer or reader slot r, a region's rank, an index's
writer) write-locks one byte of the file for as long as it holds the role. The kernel drops the
lock when the process dies, however it dies, so "the byte is not locked" means "the holder is
gone". Unlike a pid this works across containers with separate pid namespaces (the lock lives
on the shared inode), and unlike a pid it cannot be confused by a recycled pid. A child forked
while holding a role keeps the lock alive (it shares the open file description): claim roles
after forking.
"""

from __future__ import annotations

import errno
import fcntl
import struct

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid
_SEEK_SET = 0


def _request(lock_type: int, offset: int) -> bytes:
    return _FLOCK.pack(lock_type, _SEEK_SET, offset, 1, 0)


def try_lock_byte(fd: int, offset: int) -> bool:
    """Write-lock the byte at `offset`; False if another open file description holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request(fcntl.F_WRLCK, offset))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def byte_is_locked(fd: int, offset: int) -> bool:
    """Whether an open file description other than `fd`'s holds a lock on the byte."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request(fcntl.F_WRLCK, offset))
    lock_type: int = _FLOCK.unpack(answer)[0]
    return lock_type != fcntl.F_UNLCK


def byte_lock_holder_pid(fd: int, offset: int) -> int | None:
    """The pid of the process whose lock on the byte conflicts with a write lock through `fd`;
    None when the byte is free or the lock is an open file description lock (the kernel
    reports pid -1 for those: they belong to no process)."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request(fcntl.F_WRLCK, offset))
    lock_type, _, _, _, pid = _FLOCK.unpack(answer)
    return pid if lock_type != fcntl.F_UNLCK and pid > 0 else None
