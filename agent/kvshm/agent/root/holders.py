"""Whether a live process other than the agent holds a region file.

Every kvshm attacher (SharedOffloadRegion) holds a shared flock on the region file for as long
as it has it open. The agent probes with a non-blocking exclusive flock on a descriptor of its
own: it is granted only when no other open file description holds a lock. flock locks belong to
open file descriptions, so the agent's own mapping counts only if the agent kept its lock; it
lets go of it before it probes to remove a region (kvshm.agent.hosting). While the probe holds
the exclusive lock a new attacher cannot take its shared one and retries, which is what makes
"probe, then remove" safe.

A read lease (F_SETLEASE) counts as holding too: it makes the probe's open fail with EWOULDBLOCK.

Processes that map the file without kvshm (vLLM's own code) take no flock. With proc_scan the
agent also looks through /proc/<pid>/maps and /proc/<pid>/fd of every process it can see; in a
pod that needs the host's PID namespace (hostPID) and CAP_SYS_PTRACE, else it sees only its own
container. See docs/agent.md for the limits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator

from kvshm.region import safefile

FileId = tuple[int, int]  # (st_dev, st_ino)
FileCheck = Callable[[os.stat_result, str], None]


def try_exclusive(
    dir_fd: int, file_name: str, path: str, check: FileCheck = safefile.check_regular
) -> int | None:
    """A descriptor holding an exclusive flock on the file, or None when someone holds a lock.

    Raises UnsafePathError for anything `check` refuses (by default anything but a regular
    single-link file), FileNotFoundError if there is none."""
    try:
        fd = safefile.open_checked(file_name, os.O_RDWR, path, dir_fd, check)
    except BlockingIOError:
        # a process's read lease (F_SETLEASE) refuses the non-blocking open for writing
        # until the kernel breaks it (lease-break-time): that process holds the file
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _maps_file_ids(pid_dir: str) -> set[FileId]:
    ids: set[FileId] = set()
    with open(os.path.join(pid_dir, "maps"), encoding="ascii", errors="replace") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 5 or fields[4] == "0":
                continue
            major, _, minor = fields[3].partition(":")
            ids.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    return ids


def _fd_file_ids(pid_dir: str) -> set[FileId]:
    ids: set[FileId] = set()
    fd_dir = os.path.join(pid_dir, "fd")
    for entry in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(fd_dir, entry))
            ids.add((st.st_dev, st.st_ino))
    return ids


def own_lock_pid(lock_table: str) -> str:
    """The pid the lock table names for this process: the table lists pids as the PID namespace
    of its procfs sees them, which for the host's table is not os.getpid() inside a pod. Learnt
    by holding a shared flock on the table itself and finding that lock in it."""
    with open(lock_table, encoding="ascii", errors="replace") as table:
        st = os.fstat(table.fileno())
        fcntl.flock(table.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        try:
            with open(lock_table, encoding="ascii", errors="replace") as listing:
                for fields in _flock_lines(listing):
                    if _file_id(fields[5]) == (st.st_dev, st.st_ino):
                        return fields[4]
        finally:
            fcntl.flock(table.fileno(), fcntl.LOCK_UN)
    return str(os.getpid())


def _flock_lines(listing: Iterator[str]) -> Iterator[list[str]]:
    # "1: FLOCK  ADVISORY  READ  1234 00:1a:5678 0 EOF"; "->" lines are blocked waiters
    for line in listing:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK":
            yield fields


def _file_id(device_inode: str) -> FileId | None:
    try:
        major, minor, inode = device_inode.split(":")
        return (os.makedev(int(major, 16), int(minor, 16)), int(inode))
    except ValueError:
        return None


def count_flocks(lock_table: str = "/proc/locks", own_pid: str | None = None) -> dict[FileId, int]:
    """Flock holders per file from a lock table, not counting this process's own locks.

    A procfs lists only the locks of processes its PID namespace can see, so in a pod without
    hostPID the node's holders are in the host's table (the chart mounts it read-only:
    --lock-table); own_pid is this process's pid in that table (own_lock_pid)."""
    own = own_pid or str(os.getpid())
    counts: dict[FileId, int] = {}
    with open(lock_table, encoding="ascii", errors="replace") as listing:
        for fields in _flock_lines(listing):
            file_id = _file_id(fields[5])
            if fields[4] != own and file_id is not None:
                counts[file_id] = counts.get(file_id, 0) + 1
    return counts


def scan_proc(proc: str = "/proc") -> set[FileId]:
    """(dev, inode) of every file some other visible process maps or has open."""
    own = str(os.getpid())
    held: set[FileId] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit() or pid == own:
            continue
        pid_dir = os.path.join(proc, pid)
        # processes come and go, and some are not ours to read: skip what cannot be read
        with contextlib.suppress(OSError, ValueError):
            held |= _maps_file_ids(pid_dir)
        with contextlib.suppress(OSError):
            held |= _fd_file_ids(pid_dir)
    return held


class HoldChecker:
    """Probes holders: flock always, /proc when enabled (scanned at most once per refresh)."""

    def __init__(
        self, proc_scan: bool = False, proc: str = "/proc", lock_table: str | None = None
    ) -> None:
        self.proc_scan = proc_scan
        self._proc = proc
        self._lock_table = lock_table or os.path.join(proc, "locks")
        self._own_pid: str | None = None
        self._proc_held: set[FileId] = set()
        self._flocks: dict[FileId, int] | None = None

    def refresh(self) -> None:
        if self.proc_scan:
            self._proc_held = scan_proc(self._proc)
        try:
            if self._own_pid is None:
                self._own_pid = own_lock_pid(self._lock_table)
            self._flocks = count_flocks(self._lock_table, self._own_pid)
        except OSError:
            self._flocks = None  # no lock table: the count is unknown, the probe still works

    def flock_holders(self, file_id: FileId | None) -> int | None:
        """How many open files hold a flock on the file (as of the last refresh), if known."""
        if self._flocks is None or file_id is None:
            return None
        return self._flocks.get(file_id, 0)

    def held_by_process(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) in self._proc_held

    @contextlib.contextmanager
    def exclusive(
        self, dir_fd: int, file_name: str, path: str, check: FileCheck = safefile.check_regular
    ) -> Iterator[int | None]:
        """Yields a descriptor holding the file exclusively, or None when it is held; keep the
        block short, attachers wait while it runs."""
        fd = try_exclusive(dir_fd, file_name, path, check)
        if fd is not None and self.held_by_process(os.fstat(fd)):
            os.close(fd)
            fd = None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def is_held(self, dir_fd: int, file_name: str, path: str) -> bool:
        with self.exclusive(dir_fd, file_name, path) as fd:
            return fd is None
