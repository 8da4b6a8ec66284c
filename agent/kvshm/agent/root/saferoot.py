"""The region root on a hostile filesystem: every step goes through a directory descriptor.

Tenants' pods mount their region directory (a careless one the whole root), so anything below
the root may have been planted: a symlink, FIFO, file or hard link where a region's directory or
file goes. Paths are walked from the root's descriptor one component at a time with
O_NOFOLLOW|O_DIRECTORY; directories are made with mkdirat and then given owner and mode through
their own descriptor, never by path; anything unexpected is refused with an UnsafePathError that
names it. Nothing outside the root is ever opened, chmod-ed, chown-ed or removed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvshm.agent.errors import describe
from kvshm.agent.root.rootfs import require_tmpfs
from kvshm.agent.root.rootpages import probe_pages
from kvshm.api import RegionAccess, RootPages, region_key
from kvshm.api.address import is_dns_label, is_dns_subdomain
from kvshm.api.messages import printable
from kvshm.region import RegionFileName, UnsafePathError, parse_region_file_name
from kvshm.region.safefile import describe_file_type

# Root and namespace directories: traversable but not listable, so a tenant who can reach one
# cannot enumerate the other tenants' regions.
SHARED_DIR_MODE = 0o711
_LISTING_BITS = stat.S_IRGRP | stat.S_IROTH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A tenant can fill its directory with region-shaped names (10,001 empty files froze a node's
# status: the OffloadNode patch outgrew the API server's request limit). Per directory and pass,
# at most this many entries are read and this many region-shaped files listed; the excess is
# summarised in one problem line. A region has at most 32 files.
MAX_DIR_ENTRIES = 4096
MAX_REGION_FILES = 64
ProblemCallback = Callable[[str], None]
log = logging.getLogger(__name__)


def _refused(path: str, what: str, hint: str) -> UnsafePathError:
    return UnsafePathError(
        errno.EPERM, f"{path} is {what}; the agent refused to follow, open or change it. {hint}"
    )


def open_dir_at(parent_fd: int, name: str, path: str, device: int | None) -> int:
    """Open the existing directory `name` under parent_fd; refuse anything that is not a plain
    directory on the root's filesystem. FileNotFoundError when nothing has that name."""
    before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISDIR(before.st_mode):
        raise _refused(path, describe_file_type(before.st_mode), "Remove it.")
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(path, "no longer a directory", "Remove it.") from exc
        raise
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise _refused(path, "a directory that was replaced while opened", "Retried later.")
        if device is not None and after.st_dev != device:
            raise _refused(path, "a mount point", "Unmount it; regions live on the root's tmpfs.")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ensure_dir_at(parent_fd: int, name: str, path: str, device: int) -> tuple[int, bool]:
    """Open `name` as a directory, creating it (private, 0700) if missing; (fd, created)."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)  # mkdirat never follows a planted symlink
        created = True
    except FileExistsError:
        created = False
    return open_dir_at(parent_fd, name, path, device), created


def _check_agent_owned(fd: int, path: str) -> None:
    """Refuse a directory someone else could rename entries in under the agent's feet."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UnsafePathError(
            errno.EPERM,
            f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):#o}; the "
            f"agent (uid {os.geteuid()}) only uses directories it owns that no one else can "
            f"write. chown it to uid {os.geteuid()} and chmod it 0711 (or remove it).",
        )


def _exists_at(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _hide_names(fd: int, path: str) -> None:
    """Take away group's and others' read (listing) bits from a directory the agent owns, as
    SHARED_DIR_MODE intends: a root the kubelet made (0755) or a tmpfs mounted without mode=0711
    would show every host user the namespaces that have regions. Nothing else changes (a 0700
    root stays 0700); tenants' pods mount their own region directory and never list the root."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & _LISTING_BITS:
        os.fchmod(fd, mode & ~_LISTING_BITS)
        log.info("%s was mode %#o: made it %#o", path, mode, mode & ~_LISTING_BITS)


def set_owner_and_mode(fd: int, uid: int, gid: int, mode: int) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


@dataclass
class RegionDir:
    """An open region directory <root>/<namespace>/<name>/; its descriptors close on close()."""

    namespace: str
    name: str
    path: str
    fd: int
    namespace_fd: int
    problem: ProblemCallback | None = None  # where a walk's directories report their excess

    @property
    def key(self) -> str:
        return region_key(self.namespace, self.name)

    @property
    def fd_path(self) -> str:
        """A path naming exactly this open directory (no lookup of the real path can race)."""
        return f"/proc/self/fd/{self.fd}"

    def file_path(self, file_name: str) -> str:
        return os.path.join(self.path, file_name)

    def lstat(self, file_name: str) -> os.stat_result | None:
        try:
            return os.stat(file_name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entries(self, limit: int = MAX_DIR_ENTRIES) -> list[str]:
        """Names in the directory, sorted: at most `limit` of them (a tenant's directory can
        hold any number)."""
        with os.scandir(self.fd) as found:
            return sorted(entry.name for entry, _ in zip(found, range(limit), strict=False))

    def names_of(self, file_id: tuple[int, int], limit: int = 10_000) -> list[str]:
        """Names in this directory (among its first `limit` entries) of the inode `file_id`."""
        found = []
        with os.scandir(self.fd) as entries:
            for index, entry in enumerate(entries):
                if index >= limit:
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) == file_id:
                    found.append(entry.name)
        return sorted(found)

    def region_files(self) -> list[tuple[str, RegionFileName]]:
        """(file name, whose file it is) of the region-shaped names in the directory (.mmap and
        .mmap.<i> alike), sorted by name: at most MAX_REGION_FILES of them among its first
        MAX_DIR_ENTRIES entries (the rest is told to `problem`, in one line), so a tenant's
        directory costs a bounded pass and status."""
        found: list[tuple[str, RegionFileName]] = []
        unlisted = read = 0
        with os.scandir(self.fd) as entries:
            for entry in entries:
                if read == MAX_DIR_ENTRIES:
                    break
                read += 1
                parsed = parse_region_file_name(entry.name)
                if parsed is None:
                    continue
                if len(found) < MAX_REGION_FILES:
                    found.append((entry.name, parsed))
                else:
                    unlisted += 1
            more_entries = read == MAX_DIR_ENTRIES and next(entries, None) is not None
        if (unlisted or more_entries) and self.problem is not None:
            self.problem(self._excess(unlisted, more_entries))
        return sorted(found, key=lambda item: item[0])

    def _excess(self, unlisted: int, more_entries: bool) -> str:
        parts = [f"{MAX_REGION_FILES} region-shaped files listed"]
        if unlisted:
            parts.append(f"and {unlisted} more not listed")
        if more_entries:
            parts.append(f"entries beyond the first {MAX_DIR_ENTRIES} not looked at")
        return (
            f"{self.path} holds too many files ({', '.join(parts)}); a region has at most 32: "
            f"remove what is not a region's file"
        )

    def unlink_regular(
        self, file_name: str, expected: os.stat_result | None = None, *, linked_ok: bool = False
    ) -> str | None:
        """Remove `file_name` if it is a regular file with one link (any number with linked_ok,
        for a file the caller knows is its own: unlinking removes only this name) and, given
        `expected`, still that file; else leave it and say why."""
        st = self.lstat(file_name)
        if st is None:
            return None
        if not stat.S_ISREG(st.st_mode) or (st.st_nlink != 1 and not linked_ok):
            links = f" with {st.st_nlink} links" if stat.S_ISREG(st.st_mode) else ""
            return f"{self.file_path(file_name)} is {describe_file_type(st.st_mode)}{links}"
        if expected is not None and (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            return f"{self.file_path(file_name)} was replaced by another file meanwhile"
        os.unlink(file_name, dir_fd=self.fd)  # unlinkat: removes the entry, follows nothing
        return None

    def remove_if_empty(self) -> bool:
        """rmdir this directory if it is empty (then RegionRoot.remove_namespace_if_empty)."""
        try:
            os.rmdir(self.name, dir_fd=self.namespace_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return exc.errno == errno.ENOENT
            raise
        return True

    def close(self) -> None:
        for fd in (self.fd, self.namespace_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.namespace_fd = -1

    def __enter__(self) -> RegionDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegionRoot:
    """The agent's region root: an open directory on a tmpfs, that the agent owns, that only
    it can write and no one else can list."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        self.path = os.path.abspath(path)
        parent, base = os.path.split(self.path)
        if not base:
            raise ValueError(f"the region root cannot be {path!r}: use a directory below /")
        # the parent is the operator's own setting and trusted; the root itself may be planted
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create and not _exists_at(parent_fd, base):
                # a root made on a disk (its tmpfs not mounted) would be refused below anyway:
                # make nothing there
                require_tmpfs(parent_fd, parent, self.path)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(base, SHARED_DIR_MODE, dir_fd=parent_fd)
            self.fd = open_dir_at(parent_fd, base, self.path, None)
        finally:
            os.close(parent_fd)
        try:
            require_tmpfs(self.fd, self.path, self.path)
            _check_agent_owned(self.fd, self.path)
            _hide_names(self.fd, self.path)
        except BaseException:
            os.close(self.fd)
            raise
        self.device = os.fstat(self.fd).st_dev

    @functools.cached_property
    def pages(self) -> RootPages:
        """The pages a region file gets on the root, found by making one (rootpages.py) the
        first time they are asked for; the mount does not change under a running agent."""
        return probe_pages(self.fd, self.path)

    def filesystem_bytes(self) -> tuple[int, int]:
        """(capacity, free) of the root's filesystem, as an unprivileged writer sees them."""
        st = os.fstatvfs(self.fd)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def _namespace_path(self, namespace: str) -> str:
        if not is_dns_label(namespace):
            raise UnsafePathError(errno.EINVAL, f"{namespace!r} is not a namespace name")
        return os.path.join(self.path, namespace)

    def _region_path(self, namespace: str, name: str) -> str:
        if not is_dns_subdomain(name):
            raise UnsafePathError(errno.EINVAL, f"{name!r} is not a region name")
        return os.path.join(self._namespace_path(namespace), name)

    def open_region_dir(self, namespace: str, name: str) -> RegionDir | None:
        """The existing region directory, or None if it (or its namespace) does not exist."""
        path = self._region_path(namespace, name)
        try:
            ns_fd = open_dir_at(self.fd, namespace, os.path.dirname(path), self.device)
        except FileNotFoundError:
            return None
        try:
            _check_agent_owned(ns_fd, os.path.dirname(path))
            fd = open_dir_at(ns_fd, name, path, self.device)
        except FileNotFoundError:
            os.close(ns_fd)
            return None
        except BaseException:
            os.close(ns_fd)
            raise
        return RegionDir(namespace, name, path, fd, ns_fd)

    def ensure_region_dir(self, namespace: str, name: str, access: RegionAccess) -> RegionDir:
        """Open or make <root>/<namespace>/<name>/ with the region's owner and directory mode."""
        path = self._region_path(namespace, name)
        ns_path = os.path.dirname(path)
        ns_fd, created = _ensure_dir_at(self.fd, namespace, ns_path, self.device)
        try:
            if created:
                os.fchmod(ns_fd, SHARED_DIR_MODE)
            _check_agent_owned(ns_fd, ns_path)
            # one the kubelet made first (a serving pod's hostPath DirectoryOrCreate) is 0755
            _hide_names(ns_fd, ns_path)
            fd, _ = _ensure_dir_at(ns_fd, name, path, self.device)
        except BaseException:
            os.close(ns_fd)
            raise
        region_dir = RegionDir(namespace, name, path, fd, ns_fd)
        try:
            set_owner_and_mode(fd, access.uid, access.gid, access.directory_mode)
        except BaseException:
            region_dir.close()
            raise
        return region_dir

    def remove_namespace_if_empty(self, namespace: str) -> None:
        self._namespace_path(namespace)  # validates the name
        try:
            os.rmdir(namespace, dir_fd=self.fd)  # rmdir never follows a symlink
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                raise

    def walk(self, problem: ProblemCallback) -> Iterator[RegionDir]:
        """Every region directory under the root, each open only until the next is yielded.

        Entries that cannot be region directories are passed to `problem` and skipped."""
        for namespace in sorted(os.listdir(self.fd)):
            ns_path = os.path.join(self.path, printable(namespace))  # names are anyone's
            if not is_dns_label(namespace):
                problem(f"{ns_path}: not a namespace directory name; ignored")
                continue
            try:
                ns_fd = open_dir_at(self.fd, namespace, ns_path, self.device)
            except FileNotFoundError:
                continue
            except OSError as exc:  # UnsafePathError, or EACCES without CAP_DAC_OVERRIDE
                problem(f"{ns_path}: {describe(exc)}")
                continue
            try:
                _check_agent_owned(ns_fd, ns_path)
            except UnsafePathError as exc:
                os.close(ns_fd)
                problem(describe(exc))
                continue
            try:
                yield from self._walk_namespace(namespace, ns_fd, problem)
            finally:
                os.close(ns_fd)

    def _walk_namespace(
        self, namespace: str, ns_fd: int, problem: ProblemCallback
    ) -> Iterator[RegionDir]:
        for name in sorted(os.listdir(ns_fd)):
            path = os.path.join(self.path, namespace, printable(name))
            if not is_dns_subdomain(name):
                problem(f"{path}: not a region directory name; ignored")
                continue
            try:
                fd = open_dir_at(ns_fd, name, path, self.device)
            except FileNotFoundError:
                continue
            except OSError as exc:
                problem(
                    describe(exc)
                    if isinstance(exc, UnsafePathError)
                    else f"{path}: {describe(exc)}"
                )
                continue
            # the namespace descriptor belongs to walk(); the RegionDir gets its own copy
            region_dir = RegionDir(namespace, name, path, fd, os.dup(ns_fd), problem)
            try:
                yield region_dir
            finally:
                region_dir.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
