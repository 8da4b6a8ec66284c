"""Which filesystem the region root is on: regions are memory, so only a tmpfs will do.

A hostPath of type DirectoryOrCreate whose tmpfs is not mounted (yet) is a plain directory on
the node's disk; regions made there would be written to that disk and mlock its page cache. The
agent therefore asks the kernel what filesystem its open root descriptor is on (fstatfs's
f_type: no path is looked up again, so nothing can be swapped in between, and it needs no /proc
nor a mount table that matches the agent's mount namespace). /proc/self/mountinfo is read only
to name what was found in the error message. hugetlbfs and ramfs are refused too: region files
are sized with ftruncate and written through ordinary mappings, and ramfs has no size to admit
regions against; huge pages come from a tmpfs mounted with huge=.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
from dataclasses import dataclass

TMPFS_MAGIC = 0x01021994

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _StatFs(ctypes.Structure):
    # f_type comes first in every Linux ABI's struct statfs (a long on x86-64, arm64, ppc64le,
    # riscv64); the rest is room enough for any layout, never read.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_char * 256)]


_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
_libc.fstatfs.restype = ctypes.c_int


class RootFilesystemError(OSError):
    """The region root is not (or would not be) on a tmpfs; the message says what to do."""


def filesystem_magic(fd: int) -> int:
    """The f_type of the filesystem the open descriptor `fd` is on."""
    found = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(found)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs: {os.strerror(err)}")
    return found.f_type & 0xFFFFFFFF  # a 32-bit magic, whatever the field's width and sign


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    """A mount as /proc/self/mountinfo lists it."""

    fs_type: str
    mount_point: str
    options: tuple[str, ...]  # the filesystem's own (super) options: size=..., huge=...
    # the directory of the filesystem mounted there: "/" for its root, else a bind of a subtree
    fs_root: str = "/"
    flags: tuple[str, ...] = ()  # the mount's own options: rw, nosuid, nodev, noexec, ...


def _mounts_of(fd: int) -> list[Mount]:
    """Every mount of fd's device, in /proc/self/mountinfo's order (a later one on top)."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    found: list[Mount] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields, _, rest = line.partition(" - ")
                parts, after = fields.split(), rest.split()
                if len(parts) >= 6 and parts[2] == wanted and after:
                    options = tuple(after[2].split(",")) if len(after) > 2 else ()
                    found.append(
                        Mount(
                            after[0],
                            _unescape(parts[4]),
                            options,
                            fs_root=_unescape(parts[3]),
                            flags=tuple(parts[5].split(",")),
                        )
                    )
    except OSError:
        pass
    return found


def mount_at(fd: int, path: str) -> Mount | None:
    """The mount of fd's device whose mount point is `path` itself (the topmost, where mounts
    are stacked); None where `path` is only a directory inside a mount."""
    at = [mount for mount in _mounts_of(fd) if mount.mount_point == path]
    return at[-1] if at else None


def find_mount(fd: int, path: str) -> Mount | None:
    """fd's mount from mountinfo: of the mounts of fd's device, the one whose mount point is
    the longest prefix of `path`; None where /proc/self/mountinfo has no such mount."""
    found = _mounts_of(fd)
    if not found:
        return None

    def contains(mount_point: str) -> bool:
        return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")

    return max(
        found, key=lambda mount: len(mount.mount_point) if contains(mount.mount_point) else -1
    )


def describe_filesystem(fd: int, path: str) -> str:
    """fd's filesystem ("the ext4 filesystem mounted at /") from mountinfo; only the magic
    number where /proc/self/mountinfo has no such mount."""
    mount = find_mount(fd, path)
    if mount is None:
        return f"a filesystem of type {filesystem_magic(fd):#x}"
    return f"the {mount.fs_type} filesystem mounted at {mount.mount_point}"


def require_tmpfs(fd: int, path: str, root: str) -> None:
    """Refuse `root` unless the directory `path` (open as fd: the root, or the parent it would
    be made in) is on a tmpfs."""
    if filesystem_magic(fd) == TMPFS_MAGIC:
        return
    where = (
        f"{root} is on"
        if path == root
        else f"{root} does not exist and {path}, where it would be made, is on"
    )
    raise RootFilesystemError(
        errno.EINVAL,
        f"{where} {describe_filesystem(fd, path)}, not a tmpfs: regions there would be "
        f"written to that filesystem instead of held in memory. Mount a tmpfs at {root} "
        f'(docs/deploy.md, "The region root"), or point --root (the chart\'s regionRoot) at a '
        f"directory on one, such as /dev/shm/kvshm",
    )
