"""CPU memory fences for the ring's flag protocol, callable from Python.

CPython has no atomic fence in its standard library, so this module assembles one or two
instructions into a page of executable memory (written first, then made read+execute: never
writable and executable at once) and calls them through ctypes, about 100 ns a call.

Why these fences are enough. Every flag is one byte, and a single byte is written and read
whole on every CPU. Each side's accesses happen in separate C calls of the interpreter (a
memoryview or mmap item or slice operation each), which the C compiler cannot reorder across,
so only the CPU's own reordering matters. The protocol needs exactly these orders:

- writer: the loads that found a chunk free come before its stores into the chunk
  (`load_fence`); its chunk stores come before it clears the read flags (`copy_fence`); the
  cleared read flags come before `written = 1` (`store_fence`).
- reader: its read-flag load comes before its written-flag load, and both before it loads the
  chunk (`load_fence`); its chunk loads come before it sets its read flag (`load_fence`).

x86-64 (TSO): loads are not reordered with other loads, stores are not reordered with other
stores, and loads are not reordered with later stores, so `load_fence` and `store_fence`
need no instruction. The exception is non-temporal stores, which glibc's memcpy uses for
large copies and which are weakly ordered: `copy_fence` is an `sfence` after the writer's
chunk copy.

AArch64 (weakly ordered): `load_fence` is `dmb ishld` (earlier loads before later loads and
stores), `store_fence` and `copy_fence` are `dmb ishst` (earlier stores before later stores).
All processes of a node share one inner-shareable domain, so `ish` covers them.

Sleeping readers add one more order, a store before a load on both sides (the "Dekker"
pattern of an eventcount): a reader marks itself sleeping, then looks at the flags once more;
the writer sets `written = 1`, then looks for sleeping readers to wake. x86-64 reorders a
store with a later load (store buffer) and so does AArch64: `full_fence` is `mfence` and
`dmb ish` there.

If executable memory is refused (a strict SELinux or seccomp policy), the fences fall back to
a threading lock round trip, with a warning once: a locked instruction on x86-64, but not
guaranteed to be a full barrier everywhere.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform
import threading
from collections.abc import Callable

from kvshm.region import memory

log = logging.getLogger(__name__)

Fence = Callable[[], None]

_X86_SFENCE = bytes.fromhex("0faef8") + b"\xc3"  # sfence; ret
_X86_MFENCE = bytes.fromhex("0faef0") + b"\xc3"  # mfence; ret
_ARM_DMB_ISHLD = bytes.fromhex("bf3903d5") + bytes.fromhex("c0035fd6")  # dmb ishld; ret
_ARM_DMB_ISHST = bytes.fromhex("bf3a03d5") + bytes.fromhex("c0035fd6")  # dmb ishst; ret
_ARM_DMB_ISH = bytes.fromhex("bf3b03d5") + bytes.fromhex("c0035fd6")  # dmb ish; ret

_PAGE = mmap.PAGESIZE


def _no_fence() -> None:
    """A fence the CPU's own ordering makes unnecessary (see the module docstring)."""


def _machine_code_fence(code: bytes) -> Fence:
    """Place `code` in its own page, make the page read+execute, return it as a function."""
    address = memory.map_anonymous(_PAGE)
    ctypes.memmove(address, code, len(code))
    memory.mprotect(address, _PAGE, mmap.PROT_READ | mmap.PROT_EXEC)
    function: Fence = ctypes.CFUNCTYPE(None)(address)
    return function


def _lock_round_trip_fence() -> Fence:
    lock = threading.Lock()

    def fence() -> None:
        with lock:
            pass

    return fence


def _select() -> tuple[Fence, Fence, Fence, Fence, str]:
    """(load_fence, store_fence, copy_fence, full_fence, description) for this CPU."""
    machine = platform.machine().lower()
    try:
        if machine in ("x86_64", "amd64"):
            copy = _machine_code_fence(_X86_SFENCE)
            full = _machine_code_fence(_X86_MFENCE)
            return _no_fence, _no_fence, copy, full, "x86-64 TSO + sfence/mfence"
        if machine in ("aarch64", "arm64"):
            load = _machine_code_fence(_ARM_DMB_ISHLD)
            store = _machine_code_fence(_ARM_DMB_ISHST)
            full = _machine_code_fence(_ARM_DMB_ISH)
            return load, store, store, full, "aarch64 dmb ishld/ishst/ish"
    except OSError as exc:
        log.warning("kvshm.ipc: no executable page for a CPU fence (%s); using a fallback", exc)
    log.warning(
        "kvshm.ipc: no CPU fence for %r; ordering rests on a lock round trip, which is not "
        "guaranteed to be a full barrier on every CPU",
        machine,
    )
    fallback = _lock_round_trip_fence()
    return fallback, fallback, fallback, fallback, f"{machine}: lock round trip"


load_fence, store_fence, copy_fence, full_fence, FENCE_KIND = _select()
"""load_fence: earlier loads before later loads and stores. store_fence: earlier ordinary
stores before later stores. copy_fence: earlier stores of any kind, non-temporal included,
before later stores. full_fence: earlier loads and stores before later ones, stores before
loads included. FENCE_KIND says which implementation this process uses."""
