"""Huge-page assertions that hold on a machine whose memory is fragmented. The kernel gives a
tmpfs file a 4 KiB page where it finds no free 2 MiB one, and counts each such fallback in
/proc/vmstat (thp_file_fallback): a page that is not huge must be one the kernel counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvshm.region import memory

HUGE = memory.HUGE_PAGE_SIZE
VMSTAT = Path("/proc/vmstat")


def file_fallbacks() -> int:
    """How often, since boot, the kernel gave a tmpfs or file page 4 KiB for want of 2 MiB."""
    for line in VMSTAT.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == "thp_file_fallback":
            return int(value)
    raise AssertionError(f"{VMSTAT} has no thp_file_fallback: a kernel without shmem THP?")


def fallbacks_since_now() -> Callable[[], int]:
    """A counter of the fallbacks from now on (machine-wide, so at least this test's own)."""
    start = file_fallbacks()
    return lambda: file_fallbacks() - start


def assert_mapped_huge(mapped: int, size: int, fallbacks: int) -> None:
    """size bytes mapped by huge pages, but for the 2 MiB pages the kernel could not find."""
    short = size - mapped
    assert mapped > 0, f"none of {size} bytes mapped by huge pages ({fallbacks} fallbacks)"
    assert 0 <= short <= fallbacks * HUGE, (
        f"{mapped} of {size} bytes mapped by huge pages: {short} bytes short, while the kernel "
        f"reported {fallbacks} huge-page fallbacks ({fallbacks * HUGE} bytes)"
    )
