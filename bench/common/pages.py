"""Region roots with and without huge pages, for the benchmarks that compare them
(bench/populate, bench/attach, bench/vllm_plugin/pages.py): a tmpfs mounted huge=within_size
for the run, or one given; and what pages a root gives a region file, found as the agent finds
them (kvshm.agent.root.rootpages: by making one)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from kvshm.agent.root.mountroot import mount_tmpfs
from kvshm.agent.root.rootpages import describe_pages, is_huge, probe_pages
from kvshm.api import RootPages

MNT_DETACH = 2
HEADROOM = 256 * 1024**2  # beyond the region: the benchmarks' small files, one huge page a file


def root_pages(directory: str) -> RootPages:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return probe_pages(fd, directory)
    finally:
        os.close(fd)


def describe_root(directory: str) -> str:
    """'/dev/shm: 4 KiB pages (huge=never)' and the like."""
    return f"{directory}: {describe_pages(root_pages(directory))}"


def has_huge_pages(directory: str) -> bool:
    return is_huge(root_pages(directory))


@contextmanager
def huge_root(size_bytes: int, given: str | None = None) -> Iterator[str]:
    """`given` (a tmpfs with huge pages already), or a tmpfs of size_bytes and some headroom
    mounted huge=within_size in a fresh directory for as long as the context lasts (root, or
    CAP_SYS_ADMIN, needed: the error says so)."""
    if given is not None:
        if not has_huge_pages(given):
            raise SystemExit(f"--huge-directory {describe_root(given)}, not 2 MiB huge pages")
        yield given
        return
    directory = tempfile.mkdtemp(prefix="kvshm-bench-huge-")
    try:
        mount_tmpfs(directory, f"size={size_bytes + HEADROOM},huge=within_size,mode=0755")
    except OSError as exc:
        os.rmdir(directory)
        raise SystemExit(
            f"cannot mount a huge-page tmpfs for the run ({exc.strerror}): run as root, or "
            f"pass --huge-directory DIR of a tmpfs mounted with huge=within_size"
        ) from exc
    try:
        if not has_huge_pages(directory):
            raise SystemExit(
                f"a tmpfs mounted huge=within_size here gives {describe_root(directory)}: the "
                f"kernel gives tmpfs no huge pages (shmem_enabled deny?)"
            )
        yield directory
    finally:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.umount2(directory.encode(), MNT_DETACH)
        os.rmdir(directory)


VIRTIO_BALLOON = 0x0005
VIRTIO_BALLOON_F_REPORTING = 5


def free_page_reporting(devices: str = "/sys/bus/virtio/devices") -> str | None:
    """Why huge pages may populate slowly here, if this is a virtual machine whose balloon
    reports free memory to its host: the host discards every free block of 2 MiB (the kernel's
    page_reporting_order) a few seconds after it is freed, and the guest's next use of it faults
    in the host. Huge pages are such blocks; 4 KiB pages mostly are not."""
    try:
        names = os.listdir(devices)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(devices, name, "device"), encoding="ascii") as device:
                if int(device.read(), 16) != VIRTIO_BALLOON:
                    continue
            with open(os.path.join(devices, name, "features"), encoding="ascii") as features:
                bits = features.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1":
            return (
                "a virtual machine whose balloon reports free memory to its host (virtio "
                "free page reporting): a freed 2 MiB block is given back a few seconds "
                "later and faults in the host when next used, which huge pages drawn from "
                "such blocks pay at populate"
            )
    return None
