"""Sleeping until the writer publishes: Linux futexes on a word inside the ring file.

A shared (not process-private) futex is keyed by the file page it lies in, so processes in
different containers that map the same ring wait on, and wake, the same word. ctypes drops
the GIL around the system call, so a waiting thread does not stall its process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower()
)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: shared between processes
_WAKE_ALL = 0x7FFFFFFF

FUTEX_AVAILABLE = _SYS_FUTEX is not None
"""False on CPUs whose futex system call number this module does not know: waits then poll."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_uint,
]


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep up to `seconds` unless the 32-bit word at address no longer holds `expected`.

    Returns on a wake-up, a changed word, the timeout or a signal alike: the caller looks
    again in every case."""
    whole = int(seconds)
    timeout = _Timespec(whole, int((seconds - whole) * 1e9))
    _syscall(_SYS_FUTEX, address, _FUTEX_WAIT, expected, ctypes.addressof(timeout), None, 0)


def futex_wake_all(address: int) -> None:
    if not FUTEX_AVAILABLE:
        return  # nobody sleeps on the word: readers poll
    _syscall(_SYS_FUTEX, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
