"""`kvshm-agent mount-root`: put the region root on a tmpfs with huge pages.

The chart's privileged init container (regionRootMount) runs it before the agent, with the
root's hostPath mounted Bidirectional: a mount made at the root inside the container then
propagates to the host, so the agent container (started after it) and every serving pod's
hostPath below the root see the same tmpfs. It persists until the node reboots; on every
later start of the agent pod this finds the root already so and does nothing.

What it does with the root (made by the kubelet if missing):
- its region files already get huge pages (a tmpfs mounted with huge=, by this or by node
  set-up): nothing;
- it holds anything (regions of an agent that ran before on a root without huge pages):
  nothing, and says why: a mount over it would hide those files from the agent and from new
  serving pods while running engines keep theirs, and the agent would make the regions again
  on the new tmpfs, twice the memory. Drain and delete the node's regions (or remove the
  files) and restart the agent pod to have it mounted; meanwhile the agent reports the root's
  pages (its --huge-pages decides whether that is an error);
- it is empty: mounts a tmpfs there (size=, huge=, mode=0711, nosuid, nodev, noexec) and
  checks that a file made on it gets huge pages (the kernel may deny them host-wide).

Exit status: 0 when the root is left usable (mounted, already so, or kept with a warning),
1 when the mount failed, 2 for arguments it cannot use.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import re
import sys
from collections.abc import Sequence

from kvshm.agent.rootfs import TMPFS_MAGIC, filesystem_magic
from kvshm.agent.rootpages import describe_pages, is_huge, probe_pages
from kvshm.api import HugePages

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
# tmpfs's size=: bytes with an optional k, m, g, t, p or e suffix, or a percentage of memory
_SIZE = re.compile(r"[1-9][0-9]*[kKmMgGtTpPeE]?|([1-9][0-9]?|100)%")
HUGE_CHOICES = (HugePages.WITHIN_SIZE.value, HugePages.ALWAYS.value)


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
    return parser


def mount_tmpfs(root: str, options: str) -> None:
    """mount -t tmpfs -o OPTIONS,nosuid,nodev,noexec tmpfs ROOT, by the system call."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"tmpfs", root.encode(), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t tmpfs -o {options} tmpfs {root}: {os.strerror(err)}")


def mount_root(root: str, size: str, huge: str) -> tuple[int, str]:
    """Do what the module's docstring says; (exit status, what was done)."""
    root = os.path.abspath(root)
    os.makedirs(root, mode=0o711, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = probe_pages(fd, root)
        # a disk gives files large pages too: only a tmpfs holds regions
        if filesystem_magic(fd) == TMPFS_MAGIC and is_huge(found):
            return 0, f"{root} already gives region files {describe_pages(found)}: left as it is"
        entries = os.listdir(fd)
    finally:
        os.close(fd)
    if entries:
        shown = ", ".join(sorted(entries)[:5]) + (" ..." if len(entries) > 5 else "")
        return 0, (
            f"WARNING: {root} is no tmpfs with huge pages but holds {len(entries)} "
            f"{'entry' if len(entries) == 1 else 'entries'} ({shown}): a tmpfs mounted over it "
            f"would hide them, so nothing was mounted. Delete the node's regions and restart "
            f"the agent pod to mount it; until then --huge-pages decides (docs/deploy.md)"
        )
    options = f"size={size},huge={huge},mode=0711"
    try:
        mount_tmpfs(root, options)
    except OSError as exc:
        return 1, f"cannot mount the region root: {exc.strerror}"
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mounted = probe_pages(fd, root)
    finally:
        os.close(fd)
    done = f"mounted a tmpfs ({options},nosuid,nodev,noexec) at {root}"
    if not is_huge(mounted):
        return 0, (
            f"WARNING: {done}, but a file made on it gets {describe_pages(mounted)}: the "
            f"kernel gives tmpfs no huge pages here (/sys/kernel/mm/transparent_hugepage/"
            f"shmem_enabled says deny, or no transparent huge pages)"
        )
    return 0, f"{done}: region files get {describe_pages(mounted)}"


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not _SIZE.fullmatch(args.size):
        parser.error(
            f"--size {args.size!r} is not a tmpfs size: bytes with an optional k, m, g or t "
            f"suffix (256g), or a percentage of the node's memory (50%)"
        )
    status, message = mount_root(args.root, args.size, args.huge)
    warned = status != 0 or message.startswith("WARNING")
    print(f"kvshm-agent mount-root: {message}", file=sys.stderr if warned else sys.stdout)
    return status
