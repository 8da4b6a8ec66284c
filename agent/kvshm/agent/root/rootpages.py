"""Which pages a region file gets on the region root: 2 MiB huge pages on a tmpfs mounted with
huge=, else 4 KiB ones (slower to populate and to register with CUDA: docs/benchmarks.md).

The kernel is asked by doing it: a file of one huge page and one page more is made, unnamed, in
the root (O_TMPFILE: it is gone when closed), mapped as regions are (from a huge-page boundary,
MADV_HUGEPAGE) and populated. smaps then says whether its first huge page is one, and st_blocks
whether its partial last one took a whole huge page (huge=always on kernels that round a file's
tail up) — the global shmem_enabled override, the mount option and memory fragmentation all
counted as they are. The mount option itself is read from mountinfo only to name it, and to
guess where the probe cannot run (the root full, a kernel without MADV_POPULATE_WRITE).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from enum import StrEnum

from kvshm.agent.root.rootfs import find_mount
from kvshm.api import HugePages, RootPages
from kvshm.region import memory

log = logging.getLogger(__name__)

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_HUGE_SETTINGS = (HugePages.WITHIN_SIZE, HugePages.ALWAYS, HugePages.FORCE)


class HugePagesMode(StrEnum):
    """--huge-pages: what the agent does when the root gives region files no huge pages."""

    WARN = "warn"  # start, and warn: the log, the OffloadNode's HugePages condition
    REQUIRE = "require"  # refuse to start (exit 2), saying how to mount the root
    IGNORE = "ignore"  # start, say nothing


def huge_setting(fd: int, path: str, shmem_enabled: str = SHMEM_ENABLED) -> HugePages:
    """The root tmpfs's huge= option, or the host-wide override (deny, force) that wins over it."""
    try:
        with open(shmem_enabled, encoding="ascii") as setting:
            chosen = re.search(r"\[(\w+)\]", setting.read())
    except OSError:
        chosen = None
    if chosen is not None and chosen.group(1) in (HugePages.DENY, HugePages.FORCE):
        return HugePages(chosen.group(1))
    mount = find_mount(fd, path)
    if mount is None or mount.fs_type != "tmpfs":
        return HugePages.UNKNOWN
    option = next((o.partition("=")[2] for o in mount.options if o.startswith("huge=")), "never")
    return HugePages.read(option)


def probe_pages(fd: int, path: str) -> RootPages:
    """What a region file on the root (open as fd) gets; see the module's docstring."""
    setting = huge_setting(fd, path)
    huge, page = memory.HUGE_PAGE_SIZE, memory.PAGE_SIZE
    length = huge + page
    try:
        probe = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=fd)
    except OSError as exc:
        return _guess(setting, f"cannot make a probe file there: {exc.strerror}")
    try:
        reservation = mmap.mmap(-1, length + huge, mmap.MAP_PRIVATE | memory.MAP_NORESERVE)
        try:
            os.ftruncate(probe, length)
            start = memory.mapping_address(reservation)
            address = start + (-start % huge)
            memory.map_file_at(address, length, probe)
            memory.advise_huge_pages(address, length)
            memory.madvise(address, length, memory.MADV_POPULATE_WRITE)
            huge_bytes = memory.huge_mapped_bytes(address, length)
            allocated = os.fstat(probe).st_blocks * 512
        finally:
            reservation.close()
    except OSError as exc:
        return _guess(setting, f"populating a probe file there failed: {exc.strerror or exc}")
    finally:
        os.close(probe)
    if huge_bytes < huge:
        return RootPages(page, setting)
    return RootPages(huge, setting, rounds_up=allocated > length)


def _guess(setting: HugePages, why: str) -> RootPages:
    """The pages the mount option promises, where they cannot be tried (rounding up assumed
    wherever it may happen, so capacity is never overestimated)."""
    log.warning("could not try the region root's pages (%s); going by huge=%s", why, setting)
    if setting in _HUGE_SETTINGS:
        rounds_up = setting is not HugePages.WITHIN_SIZE
        return RootPages(memory.HUGE_PAGE_SIZE, setting, rounds_up=rounds_up)
    return RootPages(memory.PAGE_SIZE, setting)


def describe_pages(pages: RootPages) -> str:
    """ "2 MiB pages (huge=within_size)" and the like, for messages."""
    size = pages.size_bytes
    unit = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    rounding = ", a file's last huge page taken whole" if pages.rounds_up else ""
    return f"{unit} pages (huge={pages.huge.value}{rounding})"


def is_huge(pages: RootPages) -> bool:
    return pages.size_bytes > memory.PAGE_SIZE


def missing_huge_pages(root: str, pages: RootPages) -> str:
    """Why a root without huge pages is worse and what to do, for the refusal and the warning."""
    return (
        f"the region root {root} gives region files {describe_pages(pages)}, not 2 MiB huge "
        f"pages, on which regions populate and register with CUDA several times slower "
        f"(docs/benchmarks.md). "
        f"Mount a tmpfs with huge=within_size at {root} (the chart's regionRootMount, or a "
        f'node mount: docs/deploy.md, "The region root"), or start the agent with '
        f"--huge-pages warn or ignore"
    )
