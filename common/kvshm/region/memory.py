"""Thin, typed wrappers over the memory system calls Python's mmap module lacks.

ctypes releases the GIL around foreign calls, so madvise runs truly in parallel in threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os

PAGE_SIZE = mmap.PAGESIZE
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000  # Linux; Python 3.11's mmap module does not name it
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
MADV_HUGEPAGE = 14  # lets a tmpfs mounted huge=advise give this mapping huge pages
_PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def _huge_page_size() -> int:
    """The size of a transparent huge page (a PMD): 2 MiB on x86-64 and on arm64 with 4 KiB
    pages; the kernel says so where it offers transparent huge pages."""
    try:
        with open(_PMD_SIZE_FILE, encoding="ascii") as size:
            return int(size.read())
    except (OSError, ValueError):
        return 2 * 1024 * 1024


HUGE_PAGE_SIZE = _huge_page_size()

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.restype = ctypes.c_int
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int


def mapping_address(mapping: mmap.mmap) -> int:
    """Start address of a mapping. The temporary buffer export is dropped before returning,
    so the mapping can still be closed; the address is valid while it stays open."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _check(result: int, call: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


def map_file_at(address: int, length: int, fd: int, offset: int = 0) -> None:
    """Map `length` bytes of fd from `offset` (whole pages) shared and read-write exactly at
    `address`, replacing what was mapped there (MAP_FIXED): how several files become one
    contiguous range."""
    result = _libc.mmap(
        address,
        length,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_SHARED | MAP_FIXED,
        fd,
        offset,
    )
    if result != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {address:#x}: {os.strerror(err)}")


def map_anonymous(length: int) -> int:
    """A new private, anonymous, read-write mapping of `length` bytes, never unmapped: its
    address. For memory that must outlive every Python object (machine code, say)."""
    address = _libc.mmap(
        None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    if address in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} anonymous bytes: {os.strerror(err)}")
    return int(address)


def mprotect(address: int, length: int, protection: int) -> None:
    _check(_libc.mprotect(address, length, protection), f"mprotect at {address:#x}")


def madvise(address: int, length: int, advice: int) -> None:
    _check(_libc.madvise(address, length, advice), "madvise")


def mlock(address: int, length: int) -> None:
    _check(_libc.mlock(address, length), "mlock")


def munlock(address: int, length: int) -> None:
    _check(_libc.munlock(address, length), "munlock")


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address+length) whose pages are in memory (mincore)."""
    pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
    vector = (ctypes.c_ubyte * pages)()
    _check(_libc.mincore(address, length, vector), "mincore")
    # mincore sets bit 0 per resident page and leaves the other bits zero
    return bytes(vector).count(1) * PAGE_SIZE


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for huge pages on [address, address+length) (MADV_HUGEPAGE); False where the kernel
    has no transparent huge pages (EINVAL). A tmpfs mounted huge=advise gives a mapping huge
    pages only when so asked, and the kernel then also compacts memory to find them."""
    if _libc.madvise(address, length, MADV_HUGEPAGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"madvise(MADV_HUGEPAGE): {os.strerror(err)}")


def huge_mapped_bytes(address: int, length: int, smaps: str = "/proc/self/smaps") -> int:
    """Bytes of the shared file mappings within [address, address+length) that this process
    maps with huge pages (smaps' ShmemPmdMapped and FilePmdMapped of each mapping in it)."""
    end = address + length
    total = 0
    inside = False
    with open(smaps, encoding="ascii", errors="replace") as lines:
        for line in lines:
            head, _, rest = line.partition(" ")
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, _, stop = head.partition("-")
                inside = int(start, 16) >= address and int(stop, 16) <= end
            elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(rest.split()[0]) * 1024  # in kB
    return total
