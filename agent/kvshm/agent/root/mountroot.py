"""`kvshm-agent mount-root`: put the region root on a tmpfs with huge pages.

The chart's privileged init container (regionRootMount) runs it before the agent, with the
root's hostPath mounted Bidirectional: a mount made at the root inside the container then
propagates to the host, so the agent container (started after it) and every serving pod's
hostPath below the root see the same tmpfs. It persists until the node reboots; every later
start of the agent pod finds it there and brings it to what is asked.

What it does with the root (made by the kubelet if missing):
- a tmpfs of its own is mounted there (by an earlier agent pod, or by node set-up): its size=
  and huge= are compared with --size and --huge and, where they differ, applied by a remount
  (files stay; a size smaller than what its files take is refused by the kernel, and so here).
  Mounted without nosuid, nodev or noexec: refused, nothing changed (a remount from the
  container would change only its own view of the mount, never the host's);
- it holds nothing, or only empty directories (a serving pod's DirectoryOrCreate hostPath made
  them before the agent pod after a reboot): those are removed, one by one, never following a
  symlink nor crossing a mount, and a tmpfs is mounted there (size=, huge=, mode=0711, nosuid,
  nodev, noexec);
- it holds anything else (files, symlinks, regions made before on /dev/shm): nothing is mounted
  nor removed, and it fails saying what is there (with --huge-pages warn, the agent's own
  setting, it warns instead and the agent runs on the root as it is: a node's regions keep
  being served, with 4 KiB pages, and its OffloadNode's HugePages condition says why). A mount
  over it would hide those files from the agent and from new serving pods while running engines
  keep theirs, and the agent would make the regions again on the new tmpfs: twice the memory.
After a mount or remount it checks that a file made on the root gets huge pages (the kernel may
deny them host-wide).

Exit status: 0 when the root is the tmpfs asked for (mounted, remounted or already so), or holds
regions and --huge-pages is warn (a warning); 1 when it is not and cannot be made so here (the
message says what to do), 2 for arguments it cannot use.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import itertools
import os
import re
import stat
import sys
from collections.abc import Sequence

from kvshm.agent.root import dirwalk
from kvshm.agent.root.rootfs import TMPFS_MAGIC, Mount, filesystem_magic, mount_at
from kvshm.agent.root.rootpages import HugePagesMode, describe_pages, is_huge, probe_pages
from kvshm.agent.sizes import format_bytes
from kvshm.api import HugePages
from kvshm.region import memory

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 2, 4, 8, 32
# what tenants' files on the root must never be: setuid programs, device nodes, executables
SAFE_FLAGS = ("nosuid", "nodev", "noexec")
# tmpfs's size=: bytes with an optional k, m, g, t, p or e suffix, or a percentage of memory
_SIZE = re.compile(r"([1-9][0-9]*)([kKmMgGtTpPeE]?)|([1-9][0-9]?|100)%")
_SUFFIX_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}
HUGE_CHOICES = (HugePages.WITHIN_SIZE.value, HugePages.ALWAYS.value)
# A node's leftovers are a namespace directory or two: a root with more is not looked through.
MAX_LEFTOVER_ENTRIES = 256
MAX_LEFTOVER_DEPTH = 4  # <namespace>/<name>/ and room to spare
_SHOWN = 5  # entries named in a message

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshm-agent mount-root",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", required=True, help="the region root (the agent's --root)")
    parser.add_argument(
        "--size",
        required=True,
        help="the tmpfs's size= (e.g. 256g, or 50%% of the node's memory): what all regions "
        "on the node may use",
    )
    parser.add_argument(
        "--huge",
        choices=HUGE_CHOICES,
        default=HugePages.WITHIN_SIZE.value,
        help="the tmpfs's huge=: within_size (a file's last partial huge page in small pages; "
        "the default) or always",
    )
    parser.add_argument(
        "--huge-pages",
        choices=[mode.value for mode in HugePagesMode],
        default=HugePagesMode.REQUIRE.value,
        help="the agent's --huge-pages: with warn or ignore, a root that holds regions is "
        "left as it is with a warning (exit 0), not a failure (exit 1)",
    )
    return parser


def _mount(root: str, options: str, flags: int) -> None:
    if _libc.mount(b"tmpfs", root.encode(), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        remount = "remount," if flags & MS_REMOUNT else ""
        raise OSError(err, f"mount -o {remount}{options} {root}: {os.strerror(err)}")


def mount_tmpfs(root: str, options: str) -> None:
    """mount -t tmpfs -o OPTIONS,nosuid,nodev,noexec tmpfs ROOT, by the system call."""
    _mount(root, options, MS_NOSUID | MS_NODEV | MS_NOEXEC)


def remount_tmpfs(root: str, options: str) -> None:
    """mount -o remount,OPTIONS,nosuid,nodev,noexec ROOT: the tmpfs's size= and huge= change in
    place, its files stay."""
    _mount(root, options, MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def size_kib(size: str, total_pages: int | None = None) -> int:
    """What mountinfo shows as size= (in KiB) for a tmpfs mounted with this size=: the kernel
    rounds bytes up to whole pages, and takes a percentage of the node's memory in pages."""
    match = _SIZE.fullmatch(size)
    if match is None:
        raise ValueError(f"{size!r} is not a tmpfs size")
    page = memory.PAGE_SIZE
    if match.group(3) is not None:
        total = os.sysconf("SC_PHYS_PAGES") if total_pages is None else total_pages
        size_bytes = int(match.group(3)) * page * total // 100
    else:
        size_bytes = int(match.group(1)) << _SUFFIX_SHIFT[match.group(2).lower()]
    return -(-size_bytes // page) * page // 1024


def _mounted_size_kib(mount: Mount) -> int:
    """The tmpfs's size= in KiB; mountinfo leaves it out at the default, half the memory."""
    for option in mount.options:
        if option.startswith("size=") and option.endswith("k"):
            return int(option[len("size=") : -1])
    return size_kib("50%")


def _mounted_huge(mount: Mount) -> str:
    found = (o.partition("=")[2] for o in mount.options if o.startswith("huge="))
    return next(found, HugePages.NEVER.value)


def _own_tmpfs(fd: int, root: str) -> Mount | None:
    """The tmpfs mounted at the root itself (its whole filesystem, not a directory of a larger
    one such as the node's /dev/shm, whose size is not the root's to change); else None."""
    if filesystem_magic(fd) != TMPFS_MAGIC:
        return None
    mount = mount_at(fd, root)
    if mount is None or mount.fs_type != "tmpfs" or mount.fs_root != "/":
        return None
    return mount


def _subdirectory(dir_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _not_empty_directories(dir_fd: int) -> list[str]:
    """What under dir_fd is anything but an empty directory (or a tree of them) on its
    filesystem, each named with why."""
    walked = dirwalk.walk(dir_fd, MAX_LEFTOVER_ENTRIES, MAX_LEFTOVER_DEPTH)
    found = []
    for entry in walked.entries:
        if stat.S_ISLNK(entry.stat.st_mode):
            found.append(f"{entry.path} (a symlink)")
        elif not stat.S_ISDIR(entry.stat.st_mode):
            found.append(f"{entry.path} (a file)")
        elif entry.not_entered:
            found.append(f"{entry.path}/ ({entry.not_entered})")
    if not walked.complete:
        found.append(f"more than {MAX_LEFTOVER_ENTRIES} entries")
    return found


def _remove_empty_directories(dir_fd: int, depth: int) -> None:
    """rmdir every directory below dir_fd, deepest first; raises if any is not empty (anything
    made there since it was looked at), and rmdir never follows a symlink."""
    with os.scandir(dir_fd) as entries:
        names = [entry.name for entry in itertools.islice(entries, MAX_LEFTOVER_ENTRIES)]
    for name in names:
        if depth < MAX_LEFTOVER_DEPTH:
            child = _subdirectory(dir_fd, name)
            try:
                _remove_empty_directories(child, depth + 1)
            finally:
                os.close(child)
        os.rmdir(name, dir_fd=dir_fd)


def _listed(entries: list[str]) -> str:
    more = f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else ""
    return ", ".join(entries[:_SHOWN]) + more


def _clear_for_mount(fd: int, root: str) -> str | None:
    """Remove the empty directories the root holds; why it cannot be mounted over, if not."""
    in_the_way = _not_empty_directories(fd)
    if not in_the_way:
        try:
            _remove_empty_directories(fd, 0)
            return None
        except OSError as exc:
            in_the_way = [f"{exc.filename or 'an entry'} ({exc.strerror}: changed meanwhile)"]
    return (
        f"{root} is no tmpfs of its own and holds what is not an empty directory: "
        f"{_listed(in_the_way)}. Nothing was mounted nor removed: a tmpfs mounted over it "
        f"would hide those files from the agent and from new serving pods while running engines "
        f"keep theirs, and the agent would make the regions again on the new tmpfs (twice the "
        f"memory). Remove them on the node once no engine uses them (or turn regionRootMount "
        f"off to run the agent on the root as it is); the agent pod starts once this succeeds "
        f'(docs/deploy.md, "The region root")'
    )


def _bring_to(fd: int, root: str, mount: Mount, size: str, huge: str) -> tuple[int, str]:
    """The root's own tmpfs, remounted where its size= or huge= is not what is asked."""
    unsafe = [flag for flag in SAFE_FLAGS if flag not in mount.flags]
    if unsafe:
        return 1, (
            f"the tmpfs at {root} is mounted without {', '.join(unsafe)}: tenants write files "
            f"on it, and a setuid program, device node or executable there is one step from "
            f"root on the node. Nothing was changed (a remount from this container changes only "
            f"its own view of the mount, not the node's): on the node, run `mount -o "
            f"remount,nosuid,nodev,noexec {root}`, or unmount it once no region is on it, and "
            f"restart the agent pod"
        )
    before = (_mounted_size_kib(mount), _mounted_huge(mount))
    if before == (size_kib(size), huge):
        return _pages_on(root, f"the tmpfs at {root} is size={size},huge={huge} already")
    options = f"size={size},huge={huge}"
    try:
        remount_tmpfs(root, options)
    except OSError as exc:
        stats = os.fstatvfs(fd)
        used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        why = (
            f": its files take {format_bytes(used)}, more than size={size}; remove regions "
            f"first or ask for more"
            if exc.errno == errno.EINVAL
            else ""
        )
        return 1, f"cannot remount the region root's tmpfs ({exc.strerror}){why}"
    after = mount_at(fd, root)
    now = (_mounted_size_kib(after), _mounted_huge(after)) if after is not None else None
    if now != (size_kib(size), huge):
        return 1, f"remounted {root} with {options}, but it is now {now}, not what was asked"
    done = (
        f"remounted the tmpfs at {root}: size={before[0]}k,huge={before[1]} -> "
        f"size={now[0]}k,huge={now[1]} (files kept)"
    )
    return _pages_on(root, done)


def _pages_on(root: str, done: str) -> tuple[int, str]:
    """What was done, and the pages a file made on the root gets."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pages = probe_pages(fd, root)
    finally:
        os.close(fd)
    if not is_huge(pages):
        return 0, (
            f"WARNING: {done}, but a file made on it gets {describe_pages(pages)}: the "
            f"kernel gives tmpfs no huge pages here (/sys/kernel/mm/transparent_hugepage/"
            f"shmem_enabled says deny, or no transparent huge pages)"
        )
    return 0, f"{done}: region files get {describe_pages(pages)}"


def mount_root(
    root: str, size: str, huge: str, huge_pages: HugePagesMode = HugePagesMode.REQUIRE
) -> tuple[int, str]:
    """Do what the module's docstring says; (exit status, what was done)."""
    root = os.path.abspath(root)
    os.makedirs(root, mode=0o711, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        own = _own_tmpfs(fd, root)
        if own is not None:
            return _bring_to(fd, root, own, size, huge)
        refused = _clear_for_mount(fd, root)
    finally:
        os.close(fd)
    if refused is not None and huge_pages is HugePagesMode.REQUIRE:
        return 1, refused
    if refused is not None:  # the agent is to run without huge pages rather than not at all
        return 0, (
            f"WARNING: {refused.split('. Nothing was mounted', 1)[0]}. Nothing was mounted nor "
            f"removed, and the agent runs on the root as it is (--huge-pages {huge_pages}): "
            f"its regions get 4 KiB pages, and the OffloadNode's HugePages condition says so. "
            f"Remove them on the node once no engine uses them, and restart the agent pod"
        )
    options = f"size={size},huge={huge},mode=0711"
    try:
        mount_tmpfs(root, options)
    except OSError as exc:
        return 1, f"cannot mount the region root: {exc.strerror}"
    return _pages_on(root, f"mounted a tmpfs ({options},nosuid,nodev,noexec) at {root}")


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not _SIZE.fullmatch(args.size):
        parser.error(
            f"--size {args.size!r} is not a tmpfs size: bytes with an optional k, m, g or t "
            f"suffix (256g), or a percentage of the node's memory (50%)"
        )
    status, message = mount_root(args.root, args.size, args.huge, HugePagesMode(args.huge_pages))
    warned = status != 0 or message.startswith("WARNING")
    print(f"kvshm-agent mount-root: {message}", file=sys.stderr if warned else sys.stdout)
    return status
